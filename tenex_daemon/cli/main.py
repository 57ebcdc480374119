"""The ``tenexd`` command line (typer)."""

from __future__ import annotations

import typer

from tenex_daemon import __version__

app = typer.Typer(
    help="tenexd: the conversation brain of a team of AI agents on Nostr.", no_args_is_help=True
)


@app.command()
def version() -> None:
    """Print the tenexd version."""
    typer.echo(__version__)


@app.callback()
def main() -> None:
    """tenexd: the conversation brain of a team of AI agents on Nostr."""
