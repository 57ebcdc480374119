"""The ``send`` command: publish as the owner and print the agents' replies (the work is in ``send``)."""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from tenex_daemon.cli.conversations import SHOWN_ID_DIGITS
from tenex_daemon.cli.invocation import (
    HomeOption,
    conversation_argument,
    home_given,
    relay_urls_argument,
    run_async,
    settings_of,
)
from tenex_daemon.cli.output import EXIT_FAILURE, EXIT_USAGE, err, fail, out, printable
from tenex_daemon.cli.references import AccessError, ConversationAccess, resolve_conversation
from tenex_daemon.core.errors import TenexError
from tenex_daemon.core.vocabulary import KIND_PRIVATE_MESSAGE

if TYPE_CHECKING:
    from tenex_daemon.adapters.nostr.signer import Signer
    from tenex_daemon.app.settings import Settings
    from tenex_daemon.cli.send import SendResult
    from tenex_daemon.core.agents import Agent
    from tenex_daemon.core.events import NostrEvent


def _reply_printer(agents: list[Agent], as_json: bool) -> Callable[[Agent, NostrEvent], None]:
    """A callback printing each reply as it arrives: a JSON line, or ``[Name] text``."""
    names = {a.pubkey: a.name for a in agents}

    def show(agent: Agent, event: NostrEvent) -> None:
        if as_json:
            line = json.dumps({"reply": event.to_dict(), "agent": agent.slug}, ensure_ascii=False)
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
            return
        out.print(Text(f"[{printable(names.get(event.pubkey, agent.slug))}] ", style="bold green"), end="")
        out.print(Text(printable(event.content)))  # a model's text: no escape sequence reaches the terminal

    return show


async def _local_conversation_of(settings: Settings, event_id: str) -> dict[str, Any] | None:
    """The conversation of this home (daemon or store) that holds the event, None when none does."""
    from tenex_daemon.cli.access import open_access

    try:
        async with open_access(settings) as access:
            return await access.conversation_of_event(event_id)
    except (TenexError, OSError):  # not found, or the home's store unreadable: only a hint is lost
        return None


def _local_event_finder(settings: Settings) -> Callable[[str], Awaitable[NostrEvent | None]]:
    """A lookup of an event in this home's conversations (daemon or store), None when not there."""
    from tenex_daemon.core.events import NostrEvent

    async def find_local(event_id: str) -> NostrEvent | None:
        data = await _local_conversation_of(settings, event_id)
        for raw in (data or {}).get("history", []):
            if raw.get("id") == event_id:
                return NostrEvent.model_validate(raw)
        return None

    return find_local


async def _private_conversation_of(access: ConversationAccess, event_id: str) -> dict[str, Any] | None:
    """The private (NIP-17) conversation of this home holding the event, None when it is in none or in a
    public one."""
    try:
        data = await access.conversation_of_event(event_id)
    except AccessError as exc:
        if exc.status == 404:
            return None
        raise
    return data if data.get("root_kind") == KIND_PRIVATE_MESSAGE else None


def _private_reply_refusal(data: dict[str, Any]) -> str:
    """Why ``--reply-to`` into the private conversation ``data`` is refused, and what continues it instead
    (a private message joins the person's open private conversation with the agent: docs/PROTOCOL.md,
    "Private conversations"; its channel ``dm:<agent slug>:<person>`` names the agent)."""
    channel = str(data.get("channel") or "").split(":")
    agent = channel[1] if len(channel) == 3 and channel[0] == "dm" and channel[1] else None
    continues = f"with {agent}" if agent else "with that agent"
    return (
        f"conversation {data.get('id')} is private (NIP-17): a reply with --reply-to would publish your text "
        f'in the clear, and no agent would answer it; `tenexd send --private --to {agent or "AGENT"} "..."` '
        f"continues your open private conversation {continues} (or starts a new one)"
    )


def _reply_to_argument(settings: Settings, value: str) -> str:
    """The event id ``--reply-to`` names: a whole id, or a conversation's short id (its root's id); exit 2
    when malformed or ambiguous, or when it is in a private conversation of this home (a public reply
    would publish the text in the clear), 1 when no conversation has the short id.

    A whole id may name an event only the relays have: when the home cannot be read now, it is taken as it
    is (a private message found later is still refused before anything is signed: ``check_public_parent``).
    """
    from tenex_daemon.cli.access import open_access

    reference = conversation_argument(value, "reply-to event id")

    async def resolve() -> tuple[str, dict[str, Any] | None]:
        async with open_access(settings) as access:
            event_id = await resolve_conversation(access, reference)
            return event_id, await _private_conversation_of(access, event_id)

    if len(reference) == 64:
        try:
            event_id, private = asyncio.run(resolve())
        except (TenexError, OSError, ValueError):
            return reference
    else:
        event_id, private = run_async(resolve())
    if private is not None:
        fail(_private_reply_refusal(private), EXIT_USAGE)
    return event_id


def send(
    ctx: typer.Context,
    text: Annotated[str, typer.Argument(help="What to say.")],
    to: Annotated[str | None, typer.Option(help="Agent slug to address (default: the orchestrator).")] = None,
    reply_to: Annotated[
        str | None,
        typer.Option(
            help="Event id to reply to, or a conversation's first 4 or more hex digits (kind 1111 in its "
            "conversation; kind 1 to a kind-1 note)."
        ),
    ] = None,
    kind: Annotated[
        int | None,
        typer.Option(
            help="1: a kind-1 note (a NIP-10 reply with --reply-to), answered with kind 1; "
            "11: a new conversation root (the default); 1111: a NIP-22 reply."
        ),
    ] = None,
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait for replies.")] = 30.0,
    relay: Annotated[list[str] | None, typer.Option(help="Relay URL, ws:// or wss:// (repeatable).")] = None,
    title: Annotated[
        str | None, typer.Option(help="Title of a new kind-11 conversation (no --reply-to, no --kind 1).")
    ] = None,
    private: Annotated[
        bool,
        typer.Option(
            "--private",
            help="Send a NIP-17 private message (gift-wrapped kind 14) and read the agents' wrapped answers.",
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON lines: one per reply as it comes, then a summary.")
    ] = False,
    home: HomeOption = None,
) -> None:
    """Publish TEXT as the owner (keys/owner.key) and print the agents' replies as they arrive.

    Ends at the addressed agent's reply (the orchestrator's: the reply of an agent it routes to; exit 0),
    at a notice that the runs were stopped (`tenexd conversations stop`; exit 1) or at the timeout (exit 1).
    """
    from tenex_daemon.cli.send import (
        PrivateConversationError,
        SendError,
        check_kind,
        check_title,
        send_message,
        send_private_message,
    )

    settings = settings_of(ctx)
    if not text.strip():
        fail("TEXT is empty: give the message to send", EXIT_USAGE)
    if private and (reply_to is not None or kind is not None or title is not None):
        fail("--private sends a new private message: it takes no --reply-to, --kind or --title", EXIT_USAGE)
    try:
        check_kind(kind, reply_to is not None)
        check_title(title, kind, reply_to is not None)
    except SendError as exc:
        fail(str(exc), EXIT_USAGE)
    relays = relay_urls_argument(relay)
    owner, agents = _owner_and_agents(settings)
    daemon_up = _check_daemon(ctx, settings, agents, to, relays)
    parent_id = _reply_to_argument(settings, reply_to) if reply_to is not None else None

    def on_sent(event: NostrEvent, addressed: Agent, relays: list[str]) -> None:
        if not as_json:  # at once: the answers may take a while
            how = "privately " if private else ""
            err.print(f"sent {how}{event.id} to {addressed.slug} via {', '.join(relays)}")

    async def go() -> SendResult:
        if private:
            sent = await send_private_message(
                settings, owner, agents, text, to=to, relays=relays, timeout=timeout,
                on_reply=_reply_printer(agents, as_json), on_sent=on_sent,
            )
            # a private message may join the owner's open private conversation with the agent: its id
            # is the conversation's first message, which no answer names; the home knows it
            kept = await _local_conversation_of(settings, sent.event.id)
            if kept is not None and isinstance(kept.get("id"), str):
                sent.conversation_id = kept["id"]
            return sent
        return await send_message(
            settings, owner, agents, text, to=to, reply_to=parent_id, kind=kind, relays=relays,
            timeout=timeout, title=title, on_reply=_reply_printer(agents, as_json), on_sent=on_sent,
            find_event=_local_event_finder(settings),
        )

    try:
        result = asyncio.run(go())
    except PrivateConversationError as exc:
        fail(str(exc), EXIT_USAGE)
    except SendError as exc:
        fail(str(exc), EXIT_FAILURE)
    except (TenexError, ValueError) as exc:
        fail(str(exc), EXIT_USAGE)
    if as_json:
        sys.stdout.write(json.dumps({
            "sent": result.event.to_dict(), "conversation_id": result.conversation_id,
            "addressed": result.addressed.slug, "relays": result.relays, "answered": result.answered,
            "stopped": result.stopped is not None, "replies": len(result.replies),
        }, ensure_ascii=False) + "\n")
    else:
        err.print(f"conversation {result.conversation_id}")
        if not result.answered:
            err.print(_unanswered(ctx, settings, result, to, timeout, daemon_up))
    raise typer.Exit(0 if result.answered else EXIT_FAILURE)


def _tenexd(ctx: typer.Context) -> str:
    """``tenexd``, with the ``--home`` the command was given: how a hint names a command to run next."""
    home = home_given(ctx)
    return f"tenexd --home {shlex.quote(home)}" if home is not None else "tenexd"


def _unanswered(
    ctx: typer.Context, settings: Settings, result: SendResult, to: str | None, timeout: float,
    daemon_up: bool,
) -> str:
    """What ``send`` says when the awaited answer did not come: the runs were stopped (``stopped: ...``), or
    the wait ended first, with how to read a late answer (a local model's first answer may take a minute).

    The conversation to show is named only when the home (its daemon, else its store) holds the message sent:
    a message no daemon took in is in no conversation ``conversations show`` could find (a top-level kind-1
    note or a private message may also have joined an open one, which only the home tells). When it does
    not, the hint says so, and that the daemon is not running when none answered on the control API.
    """
    from tenex_daemon.cli.send import stopped_names

    awaited = result.addressed.slug if to and not result.addressed.orchestrator else "the agents"
    if result.stopped is not None:
        names = ", ".join(stopped_names(result.stopped))
        return f"stopped: the runs of {names} were stopped before {awaited} answered"
    kept = asyncio.run(_local_conversation_of(settings, result.event.id))
    found = kept.get("id") if kept is not None else None
    waited = f"no reply from {awaited} within {timeout:g} s"
    if isinstance(found, str):
        show = f"{_tenexd(ctx)} conversations show {found[:SHOWN_ID_DIGITS]}"
        return f"{waited} (the answer may still come: {show}, or send with a longer --timeout N)"
    why = (
        "its daemon has not taken it in (is it on the relays the message went to?)" if daemon_up
        else _silent_daemon(settings)
    )
    return (
        f"{waited} (the answer may still come: send with a longer --timeout N); this home holds no "
        f"conversation with the message: {why}, see `{_tenexd(ctx)} status`"
    )


def _owner_and_agents(settings: Settings) -> tuple[Signer, list[Agent]]:
    """The owner's signer and the home's agents; exit 2 when the home has no keys, no owner secret, one the
    daemon would refuse (not the configured owner's, none configured, nor whitelisted: the daemon's own rule,
    ``is_allowed_author``), or agents' key files that cannot be used, each with what mends it."""
    from tenex_daemon.adapters.nostr.signer import KeyFileError, Signer
    from tenex_daemon.app.home import load_agents
    from tenex_daemon.core.agents import AgentDirectory
    from tenex_daemon.core.targeting import is_allowed_author

    if not settings.project_key_path.exists():  # no keys at all: not a home init made (or the wrong one)
        fail(
            f"this home ({settings.home}) has no keys ({settings.keys_dir} holds no project.key): give the "
            f"home the daemon runs with (--home), or make its keys with `{_init_again(settings)}` "
            f"({INIT_FORCE_NOTE})",
            EXIT_USAGE,
        )
    if not settings.owner_key_path.exists():
        fail(
            f"this home has no owner secret ({settings.owner_key_path}): the owner was given by public key "
            "at init, so publish from your own Nostr client (p-tag an agent), or have a new owner key made "
            f"with `{_init_again(settings, keep_owner=True)}` (your key stays allowed, as whitelisted; "
            f"{INIT_FORCE_NOTE})",
            EXIT_USAGE,
        )
    try:
        owner = Signer.from_file(settings.owner_key_path, label="owner")
        agents = load_agents(settings)
    except KeyFileError as exc:
        fail(str(exc), EXIT_USAGE)
    if not is_allowed_author(owner.pubkey, AgentDirectory(agents), settings.owner, settings.whitelist):
        fail(_not_allowed(settings, owner.pubkey), EXIT_USAGE)
    return owner, agents


def _not_allowed(settings: Settings, pubkey: str) -> str:
    """Why ``send`` refuses to sign with ``pubkey``, the key of ``keys/owner.key``: the daemon would refuse
    what it signs (``author_not_allowed``: neither the owner, nor whitelisted, nor an agent), and no answer
    would ever come; with how to allow it."""
    allow = f'add "{pubkey}" to whitelist'
    if settings.owner is None:
        return (
            f"{settings.config_path} sets no owner, and the owner secret in {settings.owner_key_path} "
            f"({pubkey}) is not in whitelist: the daemon would refuse the message (author_not_allowed); "
            f'set owner = "{pubkey}" in {settings.config_path}, or {allow}'
        )
    return (
        f"the owner secret in {settings.owner_key_path} is {pubkey}, but the owner in "
        f"{settings.config_path} is {settings.owner}: put back the key, or the owner, that belongs there "
        f"(or {allow}: the daemon would refuse the message, author_not_allowed)"
    )


INIT_FORCE_NOTE = (
    "--force rewrites config.toml as init writes it, with these relays and project: agents added since and "
    "settings edited by hand are lost; the key files there are kept"
)
"""What ``init --force`` does to a home, said with each hint that names it (tenex_daemon/app/home.py)."""


def _init_again(settings: Settings, *, keep_owner: bool = False) -> str:
    """The ``tenexd init --force`` that gives this home its missing keys: its relays and project name given
    again; with ``keep_owner``, the configured owner (and whitelist) whitelisted, a new owner key made."""
    from tenex_daemon.app.home import DEFAULT_PROJECT_NAME
    from tenex_daemon.core import nip19

    words = ["tenexd", "--home", str(settings.home), "init", "--force"]
    for url in settings.relays.urls:
        words += ["--relay", url]
    if settings.project.name != DEFAULT_PROJECT_NAME:
        words += ["--project", settings.project.name]
    kept = [settings.owner, *settings.whitelist] if keep_owner and settings.owner else settings.whitelist
    for key in dict.fromkeys(kept):
        words += ["--whitelist", nip19.encode_npub(key)]
    return shlex.join(words)


def _silent_daemon(settings: Settings, whose: str = "its") -> str:
    """Why no daemon answered on the home's control API: ``its daemon is not running``, or, when its status
    file says its process lives, that it does not answer (stuck, or still starting)."""
    from tenex_daemon.app.status import Health, read_status

    report = read_status(settings.status_path, settings.daemon.stale_after_s)
    if report.state is Health.STOPPED:
        return f"{whose} daemon is not running"
    pid = report.data.get("pid") if report.data is not None else None
    process = f" (pid {pid})" if isinstance(pid, int) else ""
    return f"{whose} daemon{process} does not answer on its control API (stuck, or still starting?)"


def _check_daemon(
    ctx: typer.Context, settings: Settings, agents: list[Agent], to: str | None, relays: list[str]
) -> bool:
    """Whether a daemon answers on the home's control API. Exit 2, before anything is signed, when it does
    but does not serve the agent addressed (``--to``, else the one ``send`` addresses by default): it would
    never answer. Exit 1 when none answers and there is no relay to publish to, saying the daemon is not
    running."""
    from tenex_daemon.cli.client import live_status, unserved_reason
    from tenex_daemon.cli.send import SendError, addressed_agent, send_relays

    try:  # a mistyped --to is bad input, said before any relay is tried
        target = addressed_agent(agents, to, settings.default_agent_slug)
    except SendError as exc:
        if to is not None:
            fail(str(exc), EXIT_USAGE)
        target = None  # no agent at all: said where the message would go (`send_message`)
    live = asyncio.run(live_status(settings))
    tenexd = _tenexd(ctx)
    if target is not None:
        reason = unserved_reason(live, target.slug, target.pubkey)
        if reason is not None:
            fail(reason, EXIT_USAGE)
    if live is None and not send_relays(settings, relays):
        silent = _silent_daemon(settings, "the")
        fail(
            f"no relay to publish to: {silent} (see `{tenexd} status`), and no relay is "
            f"configured: pass --relay URL, set relays.urls in config.toml, or start the daemon with "
            f"`{tenexd} run --embedded-relay`",
            EXIT_FAILURE,
        )
    return live is not None
