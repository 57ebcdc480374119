"""The ``send`` command: publish as the owner and print the agents' replies (the work is in ``send``)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from tenex_daemon.adapters.nostr.signer import KeyFileError, Signer
from tenex_daemon.app.home import load_agents
from tenex_daemon.app.settings import Settings
from tenex_daemon.cli.access import open_access, resolve_conversation
from tenex_daemon.cli.invocation import HomeOption, conversation_argument, run_async, settings_of
from tenex_daemon.cli.output import EXIT_FAILURE, EXIT_USAGE, JsonOption, err, fail, out
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.errors import TenexError
from tenex_daemon.core.events import NostrEvent

if TYPE_CHECKING:
    from tenex_daemon.cli.send import SendResult


def _reply_printer(agents: list[Agent], as_json: bool) -> Callable[[Agent, NostrEvent], None]:
    """A callback printing each reply as it arrives: a JSON line, or ``[Name] text``."""
    names = {a.pubkey: a.name for a in agents}

    def show(agent: Agent, event: NostrEvent) -> None:
        if as_json:
            line = json.dumps({"reply": event.to_dict(), "agent": agent.slug}, ensure_ascii=False)
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
            return
        out.print(Text(f"[{names.get(event.pubkey, agent.slug)}] ", style="bold green"), end="")
        out.print(Text(event.content))

    return show


async def _local_conversation_of(settings: Settings, event_id: str) -> dict[str, Any] | None:
    """The conversation of this home (daemon or store) that holds the event, None when none does."""
    try:
        async with open_access(settings) as access:
            return await access.conversation_of_event(event_id)
    except TenexError:
        return None


def _local_event_finder(settings: Settings) -> Callable[[str], Awaitable[NostrEvent | None]]:
    """A lookup of an event in this home's conversations (daemon or store), None when not there."""

    async def find_local(event_id: str) -> NostrEvent | None:
        data = await _local_conversation_of(settings, event_id)
        for raw in (data or {}).get("history", []):
            if raw.get("id") == event_id:
                return NostrEvent.model_validate(raw)
        return None

    return find_local


def _reply_to_argument(settings: Settings, value: str) -> str:
    """The event id ``--reply-to`` names: a whole id, or a conversation's short id (its root's id); exit 2
    when malformed or ambiguous, 1 when no conversation has it."""
    reference = conversation_argument(value, "reply-to event id")
    if len(reference) == 64:
        return reference

    async def resolve() -> str:
        async with open_access(settings) as access:
            return await resolve_conversation(access, reference)

    return run_async(resolve())


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
    relay: Annotated[list[str] | None, typer.Option(help="Relay URL (repeatable).")] = None,
    title: Annotated[str | None, typer.Option(help="Title of a new conversation.")] = None,
    private: Annotated[
        bool,
        typer.Option(
            "--private",
            help="Send a NIP-17 private message (gift-wrapped kind 14) and read the agents' wrapped answers.",
        ),
    ] = False,
    as_json: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """Publish TEXT as the owner (keys/owner.key) and print the agents' replies as they arrive.

    Ends at the addressed agent's reply (the orchestrator's: the reply of an agent it routes to; exit 0)
    or at the timeout (exit 1).
    """
    from tenex_daemon.cli.send import SendError, check_kind, send_message, send_private_message

    settings = settings_of(ctx)
    if not text.strip():
        fail("TEXT is empty: give the message to send", EXIT_USAGE)
    if private and (reply_to is not None or kind is not None or title is not None):
        fail("--private sends a new private message: it takes no --reply-to, --kind or --title", EXIT_USAGE)
    try:
        check_kind(kind, reply_to is not None)
    except SendError as exc:
        fail(str(exc), EXIT_USAGE)
    if not settings.owner_key_path.exists():
        fail(
            f"this home has no owner secret ({settings.owner_key_path}): the owner was given by public key "
            "at init, so publish from your own Nostr client (p-tag an agent), or re-run init without --owner",
            EXIT_USAGE,
        )
    try:
        owner = Signer.from_file(settings.owner_key_path, label="owner")
        agents = load_agents(settings)
    except KeyFileError as exc:
        fail(str(exc), EXIT_USAGE)
    parent_id = _reply_to_argument(settings, reply_to) if reply_to is not None else None

    def on_sent(event: NostrEvent, addressed: Agent, relays: list[str]) -> None:
        if not as_json:  # at once: the answers may take a while
            how = "privately " if private else ""
            err.print(f"sent {how}{event.id} to {addressed.slug} via {', '.join(relays)}")

    async def go() -> SendResult:
        if private:
            sent = await send_private_message(
                settings, owner, agents, text, to=to, relays=relay or (), timeout=timeout,
                on_reply=_reply_printer(agents, as_json), on_sent=on_sent,
            )
            # a private message may join the owner's open private conversation with the agent: its id
            # is the conversation's first message, which no answer names; the home knows it
            kept = await _local_conversation_of(settings, sent.event.id)
            if kept is not None and isinstance(kept.get("id"), str):
                sent.conversation_id = kept["id"]
            return sent
        return await send_message(
            settings, owner, agents, text, to=to, reply_to=parent_id, kind=kind, relays=relay or (),
            timeout=timeout, title=title, on_reply=_reply_printer(agents, as_json), on_sent=on_sent,
            find_event=_local_event_finder(settings),
        )

    try:
        result = asyncio.run(go())
    except SendError as exc:
        fail(str(exc), EXIT_FAILURE)
    except (TenexError, ValueError) as exc:
        fail(str(exc), EXIT_USAGE)
    if as_json:
        sys.stdout.write(json.dumps({
            "sent": result.event.to_dict(), "conversation_id": result.conversation_id,
            "addressed": result.addressed.slug, "relays": result.relays, "answered": result.answered,
            "replies": len(result.replies),
        }, ensure_ascii=False) + "\n")
    else:
        err.print(f"conversation {result.conversation_id}")
        if not result.answered:
            awaited = result.addressed.slug if to and not result.addressed.orchestrator else "the agents"
            err.print(f"no reply from {awaited} within {timeout:g} s")
    raise typer.Exit(0 if result.answered else EXIT_FAILURE)
