"""The ``tenexd`` command line (typer, rich tables, ``--json`` on every listing): the app and its commands.

The home is ``--home DIR`` (before or after the command), else ``$TENEX_HOME``, else ``./.tenex``.
Exit codes: 0 success, 1 not found / not running / no answer, 2 bad input or configuration; a command
whose output's reader went away (``tenexd status | head -1``) exits 0, quietly
(:mod:`~tenex_daemon.cli.typer_app`, which also makes the help show what a person types).
The commands live by group: :mod:`~tenex_daemon.cli.daemon_commands` (version, init, run,
status, migrate), :mod:`~tenex_daemon.cli.conversations` (``conversations ...`` and ``context``),
:mod:`~tenex_daemon.cli.agents` and :mod:`~tenex_daemon.cli.send_command`. Those modules import the
daemon's parts inside the commands that use them: ``tenexd --help`` loads none of them, ``tenexd status``
only the settings and the control API's client (docs/BENCHMARKS.md, "The command line's start").
"""

from __future__ import annotations

from typing import Annotated

import typer

from tenex_daemon.cli import daemon_commands
from tenex_daemon.cli.agents import agents_app
from tenex_daemon.cli.conversations import context, conversations_app
from tenex_daemon.cli.invocation import HOME_HELP
from tenex_daemon.cli.send_command import send
from tenex_daemon.cli.typer_app import TenexTyper

app = TenexTyper(
    help="tenexd: the conversation brain of a team of AI agents on Nostr.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def print_version(asked: bool) -> None:
    """``tenexd --version``: the version, as ``tenexd version`` prints it, and nothing else run."""
    if asked:
        daemon_commands.version()
        raise typer.Exit()


@app.callback()
def main(
    home: Annotated[str | None, typer.Option("--home", help=HOME_HELP)] = None,
    version: Annotated[
        bool,
        typer.Option("--version", help="Print the version and exit.", callback=print_version, is_eager=True),
    ] = False,
) -> None:
    """tenexd: the conversation brain of a team of AI agents on Nostr."""
    # `home` is read from the context by the commands (invocation.home_of), with theirs first.
    from tenex_daemon.app.logging import configure_logging

    configure_logging("auto", "warning")  # `run` reconfigures from the settings


app.command()(daemon_commands.version)
app.command()(daemon_commands.init)
app.command()(daemon_commands.run)
app.command()(daemon_commands.status)
app.command()(context)
app.command()(daemon_commands.migrate)
app.command()(send)
app.add_typer(conversations_app, name="conversations")
app.add_typer(agents_app, name="agents")


if __name__ == "__main__":
    app()
