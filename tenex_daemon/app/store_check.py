"""A start on an empty store beside a home whose own store holds conversations is refused
(docs/ARCHITECTURE.md, "Durability contract"): ``storage.kind`` switched to PostgreSQL, or ``storage.path``
pointed at a new folder, without the conversations copied. The empty store knows no event as processed, so
the daemon would answer again every message the relays still hold, each person getting a second answer.
Before that, the store is opened (:func:`open_when_free`) waiting a moment for a command reading the home."""

from __future__ import annotations

import asyncio
import json
import shlex
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import structlog

from tenex_daemon.adapters.nostr.relay_pool import Filter
from tenex_daemon.adapters.nostr.relay_pool.subscriptions import ANY_RELAY, cursor_key
from tenex_daemon.adapters.storage.filesystem.layout import ARCHIVE_DIR, Layout
from tenex_daemon.adapters.storage.filesystem.lock import StoreLockedError
from tenex_daemon.app.embedded_relay import relay_url
from tenex_daemon.app.settings import Settings, StorageKind
from tenex_daemon.core.agents import Agent
from tenex_daemon.core.errors import TenexError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import Store
from tenex_daemon.core.search import SearchQuery
from tenex_daemon.core.vocabulary import KIND_COMMENT, KIND_NOTE

log = structlog.get_logger(__name__)

RelayFetch = Callable[[Sequence[Filter]], Awaitable[list[NostrEvent]]]
"""Ask the relays once (the relay pool's ``fetch``)."""

LOCK_WAIT_S = 3.0
"""How long a starting daemon waits for a home's lock another process holds before it is refused."""


async def open_when_free(store: Store, wait_s: float = LOCK_WAIT_S) -> None:
    """Open ``store``, waiting up to ``wait_s`` while another process holds the home's lock: a tenexd
    command reading the home while no daemon answered it (`tenexd conversations list` just before
    `scripts/run`) holds it for a moment, and the daemon's start was refused for it. A daemon holding it
    is still refused (:class:`StoreLockedError`), after the wait."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    told = False
    while True:
        try:
            await store.open()
            return
        except StoreLockedError as exc:
            if loop.time() >= deadline:
                raise
            if not told:
                log.info("store_lock_waiting", holder=exc.pid, wait_s=wait_s)
                told = True
            await asyncio.sleep(0.2)


class EmptyStoreError(TenexError):
    """The configured store holds nothing while the home's filesystem store holds conversations (or is a
    copy of it cut short)."""


COPY_KEY = "migrate.from_store"
"""The small value ``tenexd migrate --from-store`` writes in its target before anything else, ``copying
<source>``, then ``copied <source>`` once whole: a copy cut short (Ctrl-C, the database gone) is taken up
again by the same command (what it copied already is skipped), a daemon refuses to start on it meanwhile,
and a whole copy is not made twice."""
COPYING = "copying "

COPIED_AWAY_KEY = "migrate.copied_away"
"""The small value ``tenexd migrate --from-store`` writes in the store it copied from, once the copy is
whole (when, and into which store): a daemon refuses to start on that old store, which lacks all the copy
gained since (settings switched back, the copy's answers would be given again), until ``tenexd migrate
--reopen`` lifts it (:func:`reopened`)."""
COPIED_AWAY = "into "
REOPENED = "reopened "


def reopened(mark: str) -> str:
    """What :data:`COPIED_AWAY_KEY` holds once ``tenexd migrate --reopen`` lifted ``mark``: no refusal."""
    return f"{REOPENED}{datetime.now(UTC).isoformat(timespec='seconds')} (copied {mark})"


PROJECT_MARK_KEY = "store.project"
"""The project a store serves (its key's public key), written by the first daemon to start on it. One
store, one project: conversations, processed ids, cursors and channels carry no project, so two projects
on one PostgreSQL database answered each other's notes with the other's history, read each other's
conversations through an agent's tool, and swept each other's conversations."""


FIRST_START_KEY = "store.first_start"
"""When a daemon first started on the store, before any relay cursor (Unix seconds): the agents' replies from
before are not the store's to know (:func:`refuse_a_store_behind`)."""


class StoreOfAnotherProjectError(TenexError):
    """The store config.toml names serves another project."""


async def refuse_another_projects(store: Store, project_pubkey: str) -> str | None:
    """Raise :class:`StoreOfAnotherProjectError` when ``store`` (open) is marked another project's
    (:data:`PROJECT_MARK_KEY`); write nothing. Return the mark (None: nobody's yet)."""
    mark = await store.get_meta(PROJECT_MARK_KEY)
    if mark is not None and mark != project_pubkey:
        raise StoreOfAnotherProjectError(
            f"the store config.toml names serves another project (project key {mark[:16]}…, this home's is "
            f"{project_pubkey[:16]}…): one store serves one project. Give this project a database of its "
            "own (storage.dsn), or a storage.path of its own; if this home's project key was made anew "
            "(keys/project.key replaced), `tenexd migrate --reopen` makes the store this key's"
        )
    return mark


async def claim_for_project(store: Store, project_pubkey: str) -> None:
    """Mark ``store`` (open) as ``project_pubkey``'s when it is nobody's yet; raise
    :class:`StoreOfAnotherProjectError` when it is another project's (:data:`PROJECT_MARK_KEY`)."""
    async with store.lease(PROJECT_MARK_KEY):  # two projects' first daemons at once: one marks it
        if await refuse_another_projects(store, project_pubkey) is None:
            await store.set_meta(PROJECT_MARK_KEY, project_pubkey)


async def serves_this_project(settings: Settings, store: Store, project_pubkey: str | None) -> None:
    """What a command run without the daemon checks of the store it opened (writing nothing): a store another
    home could share (:func:`may_be_shared`) marked another project's is refused
    (:class:`StoreOfAnotherProjectError`): listed, changed or imported into, it would mix the projects. A home
    without a project key yet (its daemon makes one) is nobody's project."""
    if project_pubkey is not None and may_be_shared(settings):
        await refuse_another_projects(store, project_pubkey)


def may_be_shared(settings: Settings) -> bool:
    """Whether the store the settings name could serve another home too (a database, or a ``storage.path``):
    the home's own ``conversations/`` is its project's by where it lies, and is never marked."""
    return settings.storage.kind is StorageKind.POSTGRES or bool(settings.storage.path)


def copying_mark(source_home: Path) -> str:
    """What :data:`COPY_KEY` holds while a copy from ``source_home`` is under way (or was cut short)."""
    return f"{COPYING}{Path(source_home).resolve()}"


def left_in_the_home(settings: Settings) -> int:
    """How many conversations the home's own filesystem store holds (archived ones too) when the settings
    name another store; 0 when they name that one."""
    storage = settings.storage
    home = settings.home
    if storage.kind is StorageKind.FILESYSTEM and (
        storage.path is None or Path(storage.path).resolve() == home.resolve()
    ):
        return 0
    layout = Layout(home / "conversations")
    return len(layout.list_folders()) if (layout.root / ARCHIVE_DIR).is_dir() else 0


async def used_before(settings: Settings, store: Store, subscription_id: str) -> bool:
    """Whether a daemon ran on ``store`` before: it holds a conversation, or a cursor of the daemon's
    subscription (``subscription_id``) on one of the relays (a store retention emptied keeps its cursors)."""
    if await store.search(SearchQuery(limit=1)):
        return True
    return bool(await _cursor_values(store, subscription_id, relay_urls(settings)))


def relay_urls(settings: Settings) -> list[str]:
    """The relays the settings name, the embedded one included."""
    relays = settings.relays
    urls = list(relays.urls)
    if relays.embedded:
        urls.append(relay_url(relays.embedded_host, relays.embedded_port))
    return urls


async def _cursor_values(store: Store, subscription_id: str, urls: Sequence[str]) -> list[str]:
    """The stored cursors of the daemon's subscription on ``urls``, and the one no relay is named by
    (:data:`ANY_RELAY`: the relays replaced since; a home from before it has the relays' own), as stored."""
    found = []
    for url in (*urls, ANY_RELAY):
        value = await store.get_meta(cursor_key(subscription_id, url))
        if value is not None:
            found.append(value)
    return found


async def cursors(store: Store, subscription_id: str, urls: Sequence[str]) -> list[int]:
    """:func:`_cursor_values` read as Unix seconds (one that is not a number is left out)."""
    return [int(value) for value in await _cursor_values(store, subscription_id, urls) if value.isdecimal()]


async def refuse_an_empty_store_beside_the_homes(
    settings: Settings, store: Store, subscription_id: str
) -> None:
    """Raise :class:`EmptyStoreError` when ``store`` (open) was never used (:func:`used_before`) and the
    home's own filesystem store, not the one the settings name, holds conversations
    (:func:`left_in_the_home`), when it is a copy cut short (:data:`COPY_KEY`), or when it was copied into
    another store since (:data:`COPIED_AWAY_KEY`)."""
    away = await store.get_meta(COPIED_AWAY_KEY)
    if away is not None and away.startswith(COPIED_AWAY):
        raise EmptyStoreError(
            f"the store config.toml names was copied {away} by `tenexd migrate --from-store`: "
            "it lacks every conversation and answer since, and started on it the daemon would answer again "
            "what the relays still hold. Point config.toml at the copy again; to start on this store anyway "
            "(what the copy gained stays there), run `tenexd migrate --reopen`"
        )
    mark = await store.get_meta(COPY_KEY)
    if mark is not None and mark.startswith(COPYING):
        source = shlex.quote(mark.removeprefix(COPYING))
        raise EmptyStoreError(
            f"the store config.toml names is a copy cut short ({mark}): started on it, the daemon would "
            f"answer again what was not copied yet; finish it with `tenexd migrate --from-store {source}`"
        )
    held = left_in_the_home(settings)
    if not held or await used_before(settings, store, subscription_id):
        return
    storage = settings.storage
    named = {
        StorageKind.POSTGRES: "its PostgreSQL database",
        StorageKind.FILESYSTEM: f"storage.path = {storage.path!r}",
    }.get(storage.kind, f"storage.kind = {storage.kind.value!r}")
    raise EmptyStoreError(
        f"the store config.toml names ({named}) was never used, but {settings.home / 'conversations'} "
        f"holds {held}: started so, the daemon would answer again every message the relays still hold. "
        f"Copy them in first with `tenexd migrate --from-store {shlex.quote(str(settings.home))}` (the whole "
        "store: nothing is answered twice), or take in what the relays hold with `tenexd conversations "
        "rebuild --all`, or move that folder aside to start anew on purpose"
    )


async def check_the_store(
    settings: Settings, store: Store, subscription_id: str, project: str, agents: Sequence[Agent] = ()
) -> None:
    """What a daemon checks of its store (open) before it serves: that it serves this project when another
    home could share it (:func:`claim_for_project`, :func:`may_be_shared`), and that starting on it answers
    nothing again (:func:`refuse_an_empty_store_beside_the_homes`); ``project``: this home's project key.
    An agent whose key changed since is told (:func:`note_agent_keys`)."""
    if may_be_shared(settings):
        await claim_for_project(store, project)
    await refuse_an_empty_store_beside_the_homes(settings, store, subscription_id)
    await note_the_first_start(store, subscription_id, relay_urls(settings))
    await note_agent_keys(store, agents)


AGENT_KEYS_KEY = "agents.keys"
"""Each agent's public key when a daemon last started on the store (slug -> hex key), agents removed since
included: an agent whose key file was replaced, or a new agent given a removed one's slug, is told."""


async def note_agent_keys(store: Store, agents: Sequence[Agent]) -> list[str]:
    """Warn (``agent_key_changed``) of each agent whose key is not the one it had when a daemon last started
    on the store, and keep the keys; return those agents' slugs. What is stored per agent is kept by slug: the
    agent with the new key takes over its conversations' states (their sessions, what it was shown), and
    replies p-tagging the old key are no longer heard."""
    raw = await store.get_meta(AGENT_KEYS_KEY)
    try:
        before = json.loads(raw) if raw else {}
    except ValueError:
        before = {}
    before = before if isinstance(before, dict) else {}
    keys = {agent.slug: agent.pubkey for agent in agents}
    changed = [slug for slug, key in keys.items() if isinstance(was := before.get(slug), str) and was != key]
    for slug in changed:
        log.warning(
            "agent_key_changed", agent=slug, was=before[slug][:16], now=keys[slug][:16],
            note="messages p-tagging the old key are not heard; the agent keeps the old key's conversation "
            "states (its sessions among them)",
        )
    if any(before.get(slug) != key for slug, key in keys.items()):
        await store.set_meta(AGENT_KEYS_KEY, json.dumps({**before, **keys}, sort_keys=True))
    return changed


async def note_the_first_start(store: Store, subscription_id: str, urls: Sequence[str]) -> None:
    """Write :data:`FIRST_START_KEY` (now) in a store no daemon subscribed from yet (a new one, or one started
    anew beside an old one; ``urls``: the relays): the agents' replies from before it are not its to know."""
    subscribed = await _cursor_values(store, subscription_id, urls)
    if not subscribed and await store.get_meta(FIRST_START_KEY) is None:
        await store.set_meta(FIRST_START_KEY, str(int(time.time())))


class StoreBehindRelaysError(TenexError):
    """The relays hold answers of this home's agents that the store does not know: a home restored from a
    backup (or copied while its daemon ran), where the daemon would answer again what was answered since."""


BEHIND_CHECK_LIMIT = 20
"""How many of the agents' newest replies the start asks the relays for (:func:`refuse_a_store_behind`)."""


async def refuse_a_store_behind(
    store: Store, fetch: RelayFetch, agent_pubkeys: Sequence[str], subscription_id: str, window_s: int,
    urls: Sequence[str] = (),
) -> None:
    """Raise :class:`StoreBehindRelaysError` when a reply of one of ``agent_pubkeys`` (kinds 1 and 1111),
    written since the store's oldest relay cursor (minus ``window_s``), is on the relays but not processed in
    the store. Every reply is saved before it is published, so the store of a home that ran on is never
    behind; a store that never subscribed (no cursor) is not checked, nor are the agents' events from before
    its cursor or its first start (:data:`FIRST_START_KEY`: a store started anew beside an old one, another
    tenexd's, a TENEX backend's with the same keys). ``urls``: the relays, whose own cursors a home from
    before the relay-independent one has. What the relays answer is checked against the request too (a relay
    may ignore ``since``, or read an empty author list as any author's): no agents, nothing to check."""
    found = await cursors(store, subscription_id, urls)
    if not found or not agent_pubkeys:
        return
    first = await store.get_meta(FIRST_START_KEY)
    since = max(min(found) - window_s, int(first) if first is not None and first.isdecimal() else 0)
    kinds = [KIND_NOTE, KIND_COMMENT]
    authors = set(agent_pubkeys)
    wanted: Filter = {"authors": sorted(authors), "kinds": kinds, "since": since, "limit": BEHIND_CHECK_LIMIT}
    answered = await fetch([wanted])
    asked = [e for e in answered if e.pubkey in authors and e.kind in kinds and e.created_at >= since]
    unknown = [event for event in asked if not await store.is_processed(event.id)]
    if not unknown:
        return
    newest = max(unknown, key=lambda event: event.created_at)
    when = datetime.fromtimestamp(newest.created_at, UTC).isoformat(timespec="seconds")
    raise StoreBehindRelaysError(
        f"the store is behind the relays: they hold {len(unknown)} replies of this home's agents it does not "
        f"know (the newest {newest.id[:16]}… of {when}), so started on it the daemon would answer those "
        "messages again. Was the home restored from a backup, or copied while its daemon ran? Take in what "
        "the relays hold first with `tenexd conversations rebuild --all` (nothing is answered twice then), "
        "then start it"
    )
