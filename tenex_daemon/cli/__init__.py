"""The ``tenexd`` command line."""
