"""PostgresStore: conversations in PostgreSQL, shared safely by several daemons.

Events are JSON rows keyed by their conversation and place in it, found by their id through an index; an
event is accepted exactly once, whichever daemon sees it first, by its id's row in ``processed_events``
(a conversation created with a history may hold an event another holds too). The state snapshot is JSON
beside the index columns that search filters in SQL. JSON is kept as ``text``, never ``jsonb``: jsonb
refuses ``\\u0000``, which an event may hold (nothing queries inside the JSON), and ``text`` refuses the
NUL character itself, so the ``title`` column holds the title with NUL replaced (the exact one is in the
state and, when it differs, in the ``lifecycle`` JSON). ``lease`` takes a session-level advisory lock on a
dedicated connection, so two daemons never work on one conversation at once. Numbered migrations
are applied on :meth:`PostgresStore.open` under an advisory lock; a schema newer than this tenexd knows
(a newer tenexd migrated the database) is refused.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import asyncpg
import structlog

from tenex_daemon.adapters.storage.postgres_cache import LOAD_SQL, ConversationCache
from tenex_daemon.adapters.storage.postgres_errors import (
    PostgresOpenError,
    SchemaTooNewError,
    acquired,
    connect_failure,
    shown_dsn,
    unavailable_as_store_error,
)
from tenex_daemon.adapters.storage.postgres_search import lifecycle_json, search_rows, title_column
from tenex_daemon.adapters.storage.postgres_sessions import (
    CHECK_TIMEOUT_S,
    KEEPALIVE,
    LEASE_SQL,
    NAME_CHECK_S,
    NAME_RETRY_S,
    TRY_KEPT_LEASE_SQL,
    TRY_LEASE_SQL,
    KeptLock,
    cancelled,
    close_pool,
    end_session,
    hold_name,
    keep_alive,
    keep_alive_on_connect,
    keeping,
    listener_name,
    terminate,
    unlock,
)
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.erasure import owned_value_prefixes
from tenex_daemon.core.errors import (
    ConversationArchivedError,
    ConversationExistsError,
    ConversationNotFoundError,
)
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.search import ConversationSummary, SearchQuery

__all__ = ["MIGRATIONS", "PostgresOpenError", "PostgresStore", "shown_dsn"]

log = structlog.get_logger(__name__)

MIGRATIONS: tuple[tuple[int, str, str], ...] = (
    (
        1,
        "conversations, events, processed ids, meta",
        """
        CREATE TABLE conversations (
            id           text PRIMARY KEY,
            title        text NOT NULL,
            phase        text NOT NULL,
            created_at   bigint NOT NULL,
            updated_at   bigint NOT NULL,
            event_count  integer NOT NULL DEFAULT 0,
            agent_count  integer NOT NULL DEFAULT 0,
            archived     boolean NOT NULL DEFAULT false,
            participants text[] NOT NULL DEFAULT '{}',
            state        jsonb NOT NULL
        );
        CREATE INDEX conversations_updated ON conversations (updated_at DESC, id DESC);
        CREATE INDEX conversations_created ON conversations (created_at);
        CREATE INDEX conversations_participants ON conversations USING gin (participants);
        CREATE TABLE events (
            event_id        text PRIMARY KEY,
            conversation_id text NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
            seq             integer NOT NULL,
            body            jsonb NOT NULL,
            UNIQUE (conversation_id, seq)
        );
        CREATE TABLE processed_events (
            event_id text PRIMARY KEY
        );
        CREATE TABLE meta (
            key   text PRIMARY KEY,
            value text NOT NULL
        );
        """,
    ),
    (
        2,
        "conversation lifecycle: last activity, end, title and summary state",
        """
        ALTER TABLE conversations ADD COLUMN activity_at bigint NOT NULL DEFAULT 0;
        ALTER TABLE conversations ADD COLUMN ended_at bigint;
        ALTER TABLE conversations ADD COLUMN lifecycle jsonb NOT NULL DEFAULT '{}'::jsonb;
        CREATE INDEX conversations_ended ON conversations (ended_at) WHERE ended_at IS NOT NULL;
        """,
    ),
    (
        3,
        "JSON kept as text: jsonb refuses \\u0000, which an event's content, tags and the state may hold",
        """
        ALTER TABLE events ALTER COLUMN body TYPE text USING body::text;
        ALTER TABLE conversations ALTER COLUMN state TYPE text USING state::text;
        ALTER TABLE conversations ALTER COLUMN lifecycle DROP DEFAULT;
        ALTER TABLE conversations ALTER COLUMN lifecycle TYPE text USING lifecycle::text;
        ALTER TABLE conversations ALTER COLUMN lifecycle SET DEFAULT '{}';
        """,
    ),
    (
        4,
        "small values found by a key prefix through an index (byte order), not by reading the whole table",
        """
        CREATE INDEX meta_key_bytes ON meta ((key COLLATE "C"));
        """,
    ),
    (
        5,
        "an event may be in the history of more than one conversation (found by its id through an index)",
        """
        ALTER TABLE events DROP CONSTRAINT events_pkey;
        CREATE INDEX events_event_id ON events (event_id);
        """,
    ),
)
"""(version, description, SQL) in order; a released migration is never edited, only added to."""

def _key_prefix(prefix: str) -> tuple[str, list[str]]:
    """The condition (and its arguments) for the meta keys starting with ``prefix``: a range in byte
    (code point) order, which the ``meta_key_bytes`` index answers, up to the least string past them."""
    stripped = prefix.rstrip(chr(0x10FFFF))
    if not stripped:  # no string is past them: the prefix alone
        return "starts_with(key, $1)", [prefix]
    following = ord(stripped[-1]) + 1
    past = stripped[:-1] + chr(0xE000 if 0xD800 <= following <= 0xDFFF else following)  # no surrogates
    return 'key COLLATE "C" >= $1 AND key COLLATE "C" < $2 AND starts_with(key, $1)', [prefix, past]



_MIGRATION_LOCK = 0x7465_6E65_7864  # "tenexd": serializes migrations across daemons
def _event_json(event: NostrEvent) -> str:
    return event.model_dump_json()


class PostgresStore:
    """A :class:`~tenex_daemon.core.ports.ConversationStore` in PostgreSQL (asyncpg).

    ``dsn`` is a ``postgresql://`` URL. ``pool_size`` bounds the connections used
    for queries. Each advisory lock held needs a connection of its own, and a task holding one may
    wait for another further in: so conversations' leases (:meth:`lease`) have their own pool
    (``lease_pool_size``), and names (:meth:`alive`, :meth:`try_take`: a daemon's name, a
    conversation's run lease, held across a whole run) another (``name_pool_size``). A held name
    then never starves the leases taken under it, nor a held lease the queries made under it.
    A lease pool larger than the number of leases ever held around another (a channel's or a task's,
    taken by intake and by runs: one per intake lane and one per run) never runs out for good.
    """

    def __init__(
        self, dsn: str, *, pool_size: int = 10, lease_pool_size: int = 20, name_pool_size: int = 10,
        cache_size: int = 256,
    ) -> None:
        self.dsn = dsn
        self._cache = ConversationCache(cache_size)
        self.pool_size = pool_size
        self.lease_pool_size = lease_pool_size
        self.name_pool_size = name_pool_size
        self._pool: asyncpg.Pool | None = None
        self._lease_pool: asyncpg.Pool | None = None
        self._name_pool: asyncpg.Pool | None = None
        self.names_lost = 0  # the Peers port's: each name :meth:`alive` lost and takes again
        self._leased: dict[tuple[asyncio.Task[Any] | None, str], Any] = {}
        """(task, conversation id) -> the connection holding that conversation's lease for that task: the
        task's writes to the conversation go through it, so a lease lost with its connection (a database
        restart) fails them rather than letting them overwrite the next holder's."""

    @property
    def pool(self) -> asyncpg.Pool:
        """The query pool (open first)."""
        if self._pool is None:
            raise RuntimeError("PostgresStore is not open; call open() first")
        return self._pool

    @asynccontextmanager
    async def _connection(self, leased: str | None = None) -> AsyncIterator[Any]:
        """A connection of the query pool, or (``leased``: a conversation's write, or a small value's) the
        one holding the lease on that id or key for this task, if it holds one; an error that says the
        database does not answer (refused, reset, restarting, shut down) is raised as
        :class:`StoreUnavailableError`."""
        held = None if leased is None else self._leased.get((asyncio.current_task(), leased))
        with unavailable_as_store_error():
            if held is not None:
                yield held
                return
            async with acquired(self.pool) as conn:  # a connection that cannot be reset is cut, not raised
                yield conn

    async def open(self) -> None:
        """Connect and apply pending migrations; raise :class:`PostgresOpenError` (saying which database,
        its password hidden, and why) when the database cannot be reached or refuses, or its schema is newer
        than this tenexd knows."""
        if self._pool is not None:
            return
        try:
            self._pool = await self._new_pool(1, self.pool_size)
            self._lease_pool = await self._new_pool(0, self.lease_pool_size)
            self._name_pool = await self._new_pool(0, self.name_pool_size)
            applied = await self.migrate()
        except (OSError, ValueError, asyncpg.PostgresError, asyncpg.InterfaceError, PostgresOpenError) as exc:
            # ValueError: a dsn asyncpg cannot read (a port that is no number); PostgresOpenError: a schema
            # newer than this tenexd knows
            await self.close()
            reason = str(exc) or type(exc).__name__
            where = shown_dsn(self.dsn)
            error = SchemaTooNewError if isinstance(exc, SchemaTooNewError) else PostgresOpenError
            raise error(f"cannot open the PostgreSQL store at {where}: {reason}") from exc
        log.info("postgres_store_opened", migrations_applied=applied)

    async def _new_pool(self, min_size: int, max_size: int) -> Any:
        """A pool of connections with keepalive on both sides (:data:`KEEPALIVE`, :func:`keep_alive`)."""
        return await asyncpg.create_pool(
            self.dsn, min_size=min_size, max_size=max_size, server_settings=KEEPALIVE,
            init=keep_alive_on_connect,
        )

    async def migrate(self) -> list[int]:
        """Apply every migration not yet in ``schema_migrations``; return the versions applied. A schema
        newer than :data:`MIGRATIONS` knows (a newer tenexd migrated the database) is refused,
        :class:`PostgresOpenError`, and nothing is applied."""
        applied: list[int] = []
        async with self._connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
            await conn.execute(
                """CREATE TABLE IF NOT EXISTS schema_migrations (
                       version integer PRIMARY KEY,
                       description text NOT NULL,
                       applied_at timestamptz NOT NULL DEFAULT now())"""
            )
            done = {row["version"] for row in await conn.fetch("SELECT version FROM schema_migrations")}
            newest, known = max(done, default=0), MIGRATIONS[-1][0]
            if newest > known:  # a newer tenexd's tables: this one would misread them, or undo its writes
                raise SchemaTooNewError(
                    f"the database's schema (version {newest}) is newer than this tenexd knows ({known}): "
                    "upgrade tenexd"
                )
            for version, description, sql in MIGRATIONS:
                if version in done:
                    continue
                await conn.execute(sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, description) VALUES ($1, $2)",
                    version, description,
                )
                applied.append(version)
        return applied

    async def close(self) -> None:
        """Close the pools at once, within ``CHECK_TIMEOUT_S``: one whose connections do not answer by then
        (a network gone silent) has them all cut. Safe to call twice."""
        pools = [pool for pool in (self._pool, self._lease_pool, self._name_pool) if pool is not None]
        self._pool = self._lease_pool = self._name_pool = None
        await asyncio.gather(*(close_pool(pool) for pool in pools))

    async def create(self, conversation: Conversation) -> None:
        """Insert the conversation row and its history in one transaction.

        An event of the history may be stored in another conversation already (two imported TENEX files
        holding one reply): each conversation keeps it in its history, as the other stores do. The ids are
        marked processed first and in one order (sorted), as :meth:`append_event` marks its one id before
        it writes: a create and an append (or two creates) of the same events wait for each other, never
        in a circle."""
        summary = ConversationSummary.of(conversation)
        state_text = json.dumps(conversation.state_dict())
        async with self._connection() as conn, conn.transaction():
            try:
                await conn.execute(
                    """INSERT INTO conversations (id, title, phase, created_at, updated_at, event_count,
                           agent_count, archived, participants, state, activity_at, ended_at, lifecycle)
                       VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)""",
                    conversation.id, title_column(summary.title), summary.phase.value, summary.created_at,
                    summary.updated_at, summary.event_count, summary.agent_count, summary.archived,
                    summary.participants, state_text,
                    summary.activity_at, summary.ended_at, lifecycle_json(summary),
                )
            except asyncpg.UniqueViolationError:
                raise ConversationExistsError(conversation.id) from None
            if conversation.history:
                await conn.executemany(
                    "INSERT INTO processed_events (event_id) VALUES ($1) ON CONFLICT DO NOTHING",
                    [(event_id,) for event_id in sorted({e.id for e in conversation.history})],
                )
                await conn.executemany(
                    """INSERT INTO events (event_id, conversation_id, seq, body)
                       VALUES ($1, $2, $3, $4)""",
                    [(e.id, conversation.id, i, _event_json(e)) for i, e in enumerate(conversation.history)],
                )
        self._cache.keep(conversation, state_text)

    async def load(self, conversation_id: str) -> Conversation | None:
        """Read the state row and the events in order in one statement, so from one snapshot: a delete or
        an append another daemon commits meanwhile is seen whole or not at all. Of a conversation loaded
        or saved here before, only the events past those held are read (the live object held, as the
        filesystem store's cache holds it: :class:`ConversationCache`)."""
        for first_seq in (self._cache.first_seq(conversation_id), 0):
            async with self._connection() as conn:
                rows = await conn.fetch(LOAD_SQL, conversation_id, first_seq)
            conversation = self._cache.loaded(conversation_id, first_seq, rows)
            if conversation is not None or not rows or rows[0]["seq"] != -1:
                return conversation
        return None  # unreachable: a read from 0 gives the conversation, or nothing

    async def append_event(
        self, conversation_id: str, event: NostrEvent, *, state: Conversation | None = None
    ) -> bool:
        """Insert the event (committed, so durable, when this returns True). A known id changes nothing,
        ``state`` included (False): another daemon may have taken it in since the caller looked. With
        ``state``, the conversation's state is replaced in the same transaction."""
        try:
            saved = await self._append_event(conversation_id, event, state)
        except BaseException:
            self._cache.drop(conversation_id)
            raise
        if saved is None:
            return False
        if state is not None:
            self._cache.keep(state, saved)
        return True

    async def _append_event(
        self, conversation_id: str, event: NostrEvent, state: Conversation | None
    ) -> str | None:
        """:meth:`append_event`'s transaction: None for a known id, else the state text saved ("" without
        ``state``)."""
        async with self._connection(conversation_id) as conn, conn.transaction():
            fresh = await conn.fetchval(
                "INSERT INTO processed_events (event_id) VALUES ($1) ON CONFLICT DO NOTHING RETURNING true",
                event.id,
            )
            if not fresh:
                query = "SELECT archived FROM conversations WHERE id = $1"
                archived = await conn.fetchval(query, conversation_id)
                if archived is None:
                    raise ConversationNotFoundError(conversation_id)
                if archived:
                    raise ConversationArchivedError(conversation_id)
                return None
            saved = "" if state is None else await _save_state_on(conn, state)
            row = await conn.fetchrow(
                """UPDATE conversations
                      SET event_count = event_count + 1,
                          participants = CASE WHEN NOT ($2 = ANY(participants))
                                              THEN participants || $2 ELSE participants END
                    WHERE id = $1
                RETURNING event_count, archived""",
                conversation_id, event.pubkey,
            )
            if row is None:
                raise ConversationNotFoundError(conversation_id)
            if row["archived"]:
                raise ConversationArchivedError(conversation_id)
            await conn.execute(
                "INSERT INTO events (event_id, conversation_id, seq, body) VALUES ($1, $2, $3, $4)",
                event.id, conversation_id, row["event_count"] - 1, _event_json(event),
            )
        return saved

    async def save_state(self, conversation: Conversation) -> None:
        """Replace the state JSON and the index columns derived from it."""
        try:
            async with self._connection(conversation.id) as conn:
                saved = await _save_state_on(conn, conversation)
        except BaseException:
            self._cache.drop(conversation.id)
            raise
        self._cache.keep(conversation, saved)

    async def set_archived(self, conversation_id: str, archived: bool) -> None:
        """Set the archived flag."""
        async with self._connection(conversation_id) as conn:
            status = await conn.execute(
                "UPDATE conversations SET archived = $2 WHERE id = $1", conversation_id, archived
            )
        if status.endswith(" 0"):
            self._cache.drop(conversation_id)
            raise ConversationNotFoundError(conversation_id)
        self._cache.archived(conversation_id, archived)

    async def delete(self, conversation_id: str) -> bool:
        """Delete the conversation, its events (the rows cascade) and the small values that belong to
        it (its delegation threads, :mod:`~tenex_daemon.core.erasure`), in one transaction; the ids
        stay in ``processed_events``.

        The rows are gone for every query at once; their bytes stay in the table files as dead tuples
        until (auto)vacuum reclaims them, and in the write-ahead log and backups as PostgreSQL keeps them.
        """
        self._cache.drop(conversation_id)
        async with self._connection(conversation_id) as conn, conn.transaction():
            status = await conn.execute("DELETE FROM conversations WHERE id = $1", conversation_id)
            for prefix in owned_value_prefixes(conversation_id):
                condition, args = _key_prefix(prefix)
                await conn.execute(f"DELETE FROM meta WHERE {condition}", *args)
        return not status.endswith(" 0")

    async def search(self, query: SearchQuery) -> list[ConversationSummary]:
        """Filter in SQL; the fuzzy title rule and the summary's (core's ``summary_matches``) run on the
        rows found, read a page at a time up to the limit when one is set (``postgres_search``)."""
        async with self._connection() as conn:
            return await search_rows(conn, query)

    async def phase_counts(self) -> dict[tuple[str, bool], int]:
        """Count conversations by (phase, archived) in SQL."""
        async with self._connection() as conn:
            rows = await conn.fetch("SELECT phase, archived, count(*) AS n FROM conversations GROUP BY 1, 2")
        return {(r["phase"], r["archived"]): r["n"] for r in rows}

    async def is_processed(self, event_id: str) -> bool:
        """Whether the id is in ``processed_events``."""
        async with self._connection() as conn:
            found = await conn.fetchval("SELECT 1 FROM processed_events WHERE event_id = $1", event_id)
        return found is not None

    async def mark_processed(self, event_id: str) -> None:
        """Insert the id into ``processed_events``."""
        async with self._connection() as conn:
            await conn.execute(
                "INSERT INTO processed_events (event_id) VALUES ($1) ON CONFLICT DO NOTHING", event_id
            )

    async def find_event(self, event_id: str) -> tuple[str, NostrEvent] | None:
        """Look the event up by its id. An event two conversations hold (see :meth:`create`) is found in
        the one it is the root of, else in the one created first."""
        async with self._connection() as conn:
            row = await conn.fetchrow(
                """SELECT e.conversation_id, e.body
                     FROM events e JOIN conversations c ON c.id = e.conversation_id
                    WHERE e.event_id = $1
                    ORDER BY e.conversation_id = e.event_id DESC, c.created_at, c.id LIMIT 1""",
                event_id,
            )
        if row is None:
            return None
        return row["conversation_id"], NostrEvent.model_validate_json(row["body"])

    async def get_meta(self, key: str) -> str | None:
        """Return the stored value, if any."""
        async with self._connection() as conn:
            value = await conn.fetchval("SELECT value FROM meta WHERE key = $1", key)
        return None if value is None else str(value)

    async def set_meta(self, key: str, value: str) -> None:
        """Upsert the value (through the lease on ``key`` when this task holds one: a channel's or task's
        pointer, chosen under it, is not written once the lease is lost)."""
        async with self._connection(key) as conn:
            await conn.execute(
                """INSERT INTO meta (key, value) VALUES ($1, $2)
                   ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value""",
                key, value,
            )

    @property
    def commits_in_order(self) -> bool:
        """No: writes commit on pooled connections, each in its own transaction, in any order."""
        return False

    @asynccontextmanager
    async def lease(self, conversation_id: str) -> AsyncIterator[None]:
        """Hold the conversation's advisory lock on a dedicated connection while the block runs.

        Another PostgresStore (another daemon) asking for the same conversation waits until
        this block ends. If the connection breaks, PostgreSQL drops the lock with it. A database that does
        not answer is :class:`StoreUnavailableError` (the block's own errors pass as they are).
        """
        if self._lease_pool is None:
            raise RuntimeError("PostgresStore is not open; call open() first")
        async with acquired(self._lease_pool) as conn:
            with unavailable_as_store_error():
                await conn.execute(LEASE_SQL, conversation_id)
            key = (asyncio.current_task(), conversation_id)
            self._leased[key] = conn
            try:
                yield
            finally:
                del self._leased[key]
                await unlock(conn, conversation_id)

    @asynccontextmanager
    async def alive(self, name: str) -> AsyncIterator[None]:
        """Hold ``name``'s advisory lock (a daemon's own name) for the whole block, taking it again on a
        new connection whenever the one holding it breaks (a database restart drops every lock with its
        connection; a peer believes a free name only after a grace time, see the daemon's takeover).

        A first try that fails raises as :meth:`open` does, naming the database (its password hidden) and
        the driver's reason (:func:`connect_failure`): :class:`StoreUnavailableError` when the database
        does not answer, :class:`PostgresOpenError` when it refuses; a lock still held by another session
        past its wait is ``TimeoutError``."""
        if self._name_pool is None:
            raise RuntimeError("PostgresStore is not open; call open() first")
        async with keeping(lambda first: self._keep_name(name, first), f"postgres name {name}"):
            yield

    async def _keep_name(self, name: str, first: asyncio.Future[None]) -> None:
        """Hold ``name``'s lock until cancelled. Once its connection is broken (or silent for
        ``CHECK_TIMEOUT_S``), take the name again (every ``NAME_RETRY_S`` while the database is
        unreachable), first ending the session that held it or waited for it: the name waits for a silent
        session that cannot be ended yet, and is free only for a moment once the database answers."""
        assert self._name_pool is not None
        stale: list[tuple[int, Any]] = []
        """This keeper's sessions whose connection failed after asking for the name: each is ended before
        the name is asked for again, so none holds it unseen."""
        while True:
            try:
                async with self._name_pool.acquire() as conn:
                    await hold_name(conn, name, first, stale)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the connection or the server went away: take the name again
                if not first.done():
                    first.set_exception(connect_failure(error, self.dsn, f"hold the name {name!r}"))
                    return
                self.names_lost += 1
                log.warning("postgres_name_lost", name=name, error=repr(error))
            await asyncio.sleep(NAME_RETRY_S)

    @asynccontextmanager
    async def try_take(self, name: str, on_lost: Callable[[], None] | None = None) -> AsyncIterator[bool]:
        """Take ``name``'s advisory lock if it is free (its holder is gone); yield whether it was.

        With ``on_lost`` (a run's lease), a lock taken is kept for the whole block: a database restart
        drops it with its connection, so it is then taken again on a new connection as soon as the
        database answers, and ``on_lost`` is called (once) if another took it first. A database that does
        not answer is :class:`StoreUnavailableError` (the block's own errors pass as they are).
        """
        if self._name_pool is None:
            raise RuntimeError("PostgresStore is not open; call open() first")
        async with acquired(self._name_pool) as conn:
            with unavailable_as_store_error():
                if on_lost is None:
                    taken, session = bool(await conn.fetchval(TRY_LEASE_SQL, name)), None
                else:
                    row: Any = await conn.fetchrow(TRY_KEPT_LEASE_SQL, name)
                    taken, session = bool(row["taken"]), (int(row["pid"]), row["started"])
            if not taken or session is None or on_lost is None:
                try:
                    yield taken
                finally:
                    if taken:
                        await unlock(conn, name)
                return
            kept = KeptLock(conn, session)
            keeper = asyncio.create_task(self._keep_taken(name, kept, on_lost), name=f"postgres lock {name}")
            try:
                yield True
            finally:
                try:
                    await cancelled(keeper)
                finally:
                    if kept.own is not None:
                        kept.own.terminate()  # its session ends, and the lock with it
                    elif kept.conn is not None:
                        await unlock(kept.conn, name)

    async def _keep_taken(self, name: str, kept: KeptLock, on_lost: Callable[[], None]) -> None:
        """Check the connection holding ``name``'s lock every ``NAME_CHECK_S``; once it is broken (or
        silent for ``CHECK_TIMEOUT_S``), take the lock again on a connection of its own, or call
        ``on_lost`` when another session holds it now."""
        assert kept.conn is not None
        while True:
            await asyncio.sleep(NAME_CHECK_S)
            try:
                await kept.conn.fetchval("SELECT 1", timeout=CHECK_TIMEOUT_S)
                continue
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the lock went with its connection (or will, once it is ended)
                log.warning("postgres_lock_connection_lost", name=name, error=repr(error))
            terminate(kept.conn)
            if not await self._take_again(name, kept):
                log.error("postgres_lock_lost", name=name, reason="taken by another")
                on_lost()
                return
            log.warning("postgres_lock_taken_again", name=name)

    async def _take_again(self, name: str, kept: KeptLock) -> bool:
        """Take ``name``'s lock on a new connection of its own once the database answers (trying every
        ``NAME_RETRY_S`` until then); return whether it was free (the connection then holds it).

        The session that held it is ended first and waited for, so a lock it still holds (a silent
        connection, a backend still exiting) is never taken for another daemon's.
        """
        while True:
            conn: Any = None
            try:
                conn = await asyncpg.connect(self.dsn, server_settings=KEEPALIVE)
                keep_alive(conn)
                await end_session(conn, kept.session)
                row: Any = await conn.fetchrow(TRY_KEPT_LEASE_SQL, name, timeout=CHECK_TIMEOUT_S)
                taken = bool(row["taken"])
            except asyncio.CancelledError:
                if conn is not None:
                    conn.terminate()
                raise
            except Exception as error:  # the database is not back yet
                if conn is not None:
                    conn.terminate()
                log.info("postgres_lock_retake_waits", name=name, error=repr(error))
                await asyncio.sleep(NAME_RETRY_S)
                continue
            if not taken:
                conn.terminate()
                kept.conn = None
                return False
            kept.conn = kept.own = conn
            kept.session = (int(row["pid"]), row["started"])
            return True

    async def tell(self, channel: str, message: str) -> None:
        """NOTIFY ``channel`` with ``message``: every connection of this database listening on it hears
        it once (a daemon not listening then never does)."""
        async with self._connection() as conn:
            await conn.execute("SELECT pg_notify($1, $2)", channel, message)

    async def hearers(self, channel: str) -> int:
        """How many connections of this database listen on ``channel`` now (by their ``application_name``;
        one the server has just ended may still be counted)."""
        async with self._connection() as conn:
            found = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name = $1",
                listener_name(channel),
            )
        return int(found)

    @asynccontextmanager
    async def hear(self, channel: str, on_message: Callable[[str], None]) -> AsyncIterator[None]:
        """LISTEN on ``channel`` on a connection of its own (a pool's would stop listening when given
        back) for the whole block, listening again on a new one whenever it breaks (messages told in
        between are not heard). A first connection that cannot be made raises as in :meth:`alive`."""
        keep = partial(self._keep_listening, channel, on_message)
        async with keeping(keep, f"postgres listen {channel}"):
            yield

    async def _keep_listening(
        self, channel: str, on_message: Callable[[str], None], first: asyncio.Future[None]
    ) -> None:
        """Listen until cancelled; after a broken connection, connect and listen again (every
        ``NAME_RETRY_S`` while the database is unreachable)."""

        def deliver(_conn: Any, _pid: int, _channel: str, payload: str) -> None:
            try:
                on_message(payload)
            except Exception as error:  # one bad message never ends the listening
                log.error("postgres_message_failed", channel=channel, error=repr(error))

        while True:
            conn: Any = None
            try:
                name = listener_name(channel)
                settings = {**KEEPALIVE, "application_name": name}
                conn = await asyncpg.connect(self.dsn, server_settings=settings)
                keep_alive(conn)
                await conn.add_listener(channel, deliver)
                if not first.done():
                    first.set_result(None)
                else:
                    log.warning("postgres_listening_again", channel=channel)
                while True:  # a broken connection shows on the next round trip (a silent one: its timeout)
                    await asyncio.sleep(NAME_CHECK_S)
                    await conn.fetchval("SELECT 1", timeout=CHECK_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the connection or the server went away: listen again
                if not first.done():
                    first.set_exception(connect_failure(error, self.dsn, f"listen on {channel!r}"))
                    return
                log.warning("postgres_listening_lost", channel=channel, error=repr(error))
            finally:
                if conn is not None:
                    conn.terminate()  # at once: a broken connection would make a polite close wait
            await asyncio.sleep(NAME_RETRY_S)

    async def keys_with_prefix(self, prefix: str) -> list[str]:
        """The meta keys starting with ``prefix``."""
        async with self._connection() as conn:
            condition, args = _key_prefix(prefix)
            rows = await conn.fetch(f"SELECT key FROM meta WHERE {condition} ORDER BY key", *args)
        return [str(row["key"]) for row in rows]

    async def forget(self, key: str) -> None:
        """Delete a meta value."""
        async with self._connection() as conn:
            await conn.execute("DELETE FROM meta WHERE key = $1", key)


async def _save_state_on(conn: Any, conversation: Conversation) -> str:
    """Replace a conversation's state JSON and the index columns derived from it, on ``conn``; return the
    JSON."""
    summary = ConversationSummary.of(conversation)
    state_text = json.dumps(conversation.state_dict())
    status = await conn.execute(
        """UPDATE conversations SET title = $2, phase = $3, created_at = $4, updated_at = $5,
                  agent_count = $6, state = $7, activity_at = $8, ended_at = $9, lifecycle = $10
            WHERE id = $1""",
        conversation.id, title_column(summary.title), summary.phase.value, summary.created_at,
        summary.updated_at, summary.agent_count, state_text,
        summary.activity_at, summary.ended_at, lifecycle_json(summary),
    )
    if status.endswith(" 0"):
        raise ConversationNotFoundError(conversation.id)
    return state_text
