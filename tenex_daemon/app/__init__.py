"""The application: settings, wiring, daemon lifecycle, control API, logging, metrics."""
