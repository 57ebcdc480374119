"""What a command takes from its invocation: the home, the settings, and async work run to an exit code.

``--home`` is accepted before the command (an option of ``tenexd`` itself), between a command
group and its command (``tenexd conversations --home X list``) and after it (an option of every
command, :data:`HomeOption`); the one nearest the command wins. Without any, the home is
``$TENEX_HOME``, else ``./.tenex``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from tenex_daemon.app.home_dir import DEFAULT_HOME, resolve_home
from tenex_daemon.cli.output import EXIT_FAILURE, EXIT_USAGE, fail
from tenex_daemon.cli.references import (
    AccessError,
    ConversationAccess,
    conversation_reference,
    normalize_event_id,
    resolve_conversation,
)
from tenex_daemon.core.errors import TenexError

if TYPE_CHECKING:
    from tenex_daemon.app.settings import Settings

T = TypeVar("T")

HOME_HELP = f"Project home (default: $TENEX_HOME, else ./{DEFAULT_HOME})."

HomeOption = Annotated[
    str | None,
    typer.Option(
        "--home", help=f"{HOME_HELP} Also accepted before the command (the nearest wins).", show_default=False
    ),
]
"""The ``--home`` every command declares; :func:`home_of` reads it (the parameter itself goes unused)."""


def home_given(ctx: typer.Context) -> str | None:
    """Return the ``--home`` given nearest the command (the command's, its group's, tenexd's); None when
    none was given."""
    current: typer.Context | None = ctx
    while current is not None:
        given: str | None = current.params.get("home")
        if given is not None:
            return given
        current = current.parent  # type: ignore[assignment]  # click's Context: typer's at run time
    return None


def home_of(ctx: typer.Context) -> Path:
    """Return the home of the command's ``--home``, else tenexd's, else ``$TENEX_HOME``, else ``./.tenex``;
    exit 2 for an empty ``--home`` (``--home "$UNSET"``), which would make the current folder the home."""
    given = home_given(ctx)
    if given is not None and not str(given).strip():
        fail("--home is empty: give the home's folder (an unset variable in `--home \"$VAR\"`?)", EXIT_USAGE)
    return resolve_home(given)


def relay_urls_argument(urls: Sequence[str] | None) -> list[str]:
    """Return the ``--relay`` URLs given, each once; exit 2 naming the first that does not start with ws://
    or wss:// (as ``init`` and config.toml's ``relays.urls`` refuse it)."""
    from tenex_daemon.app.settings import first_bad_relay_url

    given = list(dict.fromkeys(urls or ()))
    bad = first_bad_relay_url(given)
    if bad is not None:
        fail(bad, EXIT_USAGE)
    return given


def settings_of(ctx: typer.Context) -> Settings:
    """Load the home's settings; exit 2 naming the problem when they are invalid."""
    from tenex_daemon.app.settings import SettingsError, load_settings

    try:
        return load_settings(home_of(ctx))
    except SettingsError as exc:
        fail(str(exc), EXIT_USAGE)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro``; an :class:`AccessError` exits 2 (bad input) or 1; other TenexError, ValueError 2."""
    try:
        return asyncio.run(coro)
    except AccessError as exc:
        fail(exc.message, EXIT_USAGE if exc.status == 400 else EXIT_FAILURE)
    except (TenexError, ValueError) as exc:
        fail(str(exc), EXIT_USAGE)


def with_access(ctx: typer.Context, action: Callable[[ConversationAccess], Awaitable[T]]) -> T:
    """Run ``action`` on the conversations: through the daemon's control API if it answers, else the store."""
    from tenex_daemon.cli.access import open_access

    settings = settings_of(ctx)

    async def go() -> T:
        async with open_access(settings) as access:
            return await action(access)

    return run_async(go())


def with_conversation(
    ctx: typer.Context, value: str, action: Callable[[ConversationAccess, str], Awaitable[T]]
) -> tuple[str, T]:
    """Run ``action`` on the conversation an ID argument names, a whole id or a short one (its first hex
    digits, resolved where the conversations are); return the conversation's id and the result. Exit 2
    when the argument is malformed or the short id starts several ids, 1 when no conversation has it."""
    reference = conversation_argument(value)

    async def act(access: ConversationAccess) -> tuple[str, T]:
        conversation_id = await resolve_conversation(access, reference)
        return conversation_id, await action(access, conversation_id)

    return with_access(ctx, act)


def conversation_argument(value: str, what: str = "conversation id") -> str:
    """Return the whole id, or the short id's digits, a conversation argument gives
    (:func:`~tenex_daemon.cli.access.conversation_reference`); exit 2 when it is malformed."""
    try:
        return conversation_reference(value, what)
    except AccessError as exc:
        fail(exc.message, EXIT_USAGE)


def event_id_argument(value: str, what: str = "conversation id") -> str:
    """Return the hex id of a hex, ``note1`` or ``nevent1`` argument; exit 2 when it is malformed."""
    try:
        return normalize_event_id(value, what)
    except AccessError as exc:
        fail(exc.message, EXIT_USAGE)
