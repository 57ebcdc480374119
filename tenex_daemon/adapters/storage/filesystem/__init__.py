"""FileSystemStore: the default durable store, plain files under the home's ``conversations/``.

Layout (``home/conversations/``; names in ``layout.py``)::

    .lock                     exclusive lock of the home, holds the owner's pid (lock.py)
    <id>/events.log           append-only event log, one checksummed JSON line per event (logfile.py)
    <id>/state.json           everything but history, replaced atomically (temp file, rename) (folder.py)
    archive/<id>/             archived conversations (read-only until restored)
    corrupt/                  unreadable files moved aside (never deleted) (repairs.py)
    .index/snapshot.json      the index of conversations, rewritten only on compaction (index.py)
    .index/log.<gen>          index changes since that snapshot, appended incrementally
    .events/<xyz>             event id -> conversation id (the processed set), 4,096 buckets (processed.py)
    .meta/<hash>.json         small values kept beside conversations
    .journal/<generation>     batch's commit journal (journal.py), gone after a clean close

Durability: an event line is written and fsynced before ``append_event`` returns (``always``,
``direct.py``), or (``batch``, ``group_commit.py``) written to its log and recorded in the
home's commit journal, whose one fsync per group commit makes every write of the group
(appends, snapshots, new conversations, meta values) durable before any is acknowledged; a
checkpoint fsyncs the files written and renews the journal, and open replays a journal left
behind (``journal_replay.py``). Every write goes through ``committer.py``.
The index and the event-id buckets are derived data (``derived.py``), written every
``FLUSH_INTERVAL`` seconds after the events they describe are durable, and fsynced when the index is
compacted (at the latest by a clean close); on open (``recovery.py``) each indexed log is checked by
size with ``stat``, and a log whose size disagrees is rescanned, its torn tail cut, its entry repaired.
A log grown since the index snapshot (after a crash; a clean close compacts) is read from the size
the snapshot counted even when the index log agrees with it, and its event ids are filed again: a power
loss may have kept an index line and lost a bucket line. A derived line that cannot
be written (a full disk) waits for the next round, and holds back the index lines and the index
snapshot that would tell open the logs are complete.
"""

from tenex_daemon.adapters.storage.filesystem.index import IndexEntry
from tenex_daemon.adapters.storage.filesystem.layout import LOG_NAME, STATE_NAME
from tenex_daemon.adapters.storage.filesystem.lock import StoreLockedError
from tenex_daemon.adapters.storage.filesystem.logfile import LogScan, encode_event, encode_line, scan_log
from tenex_daemon.adapters.storage.filesystem.repairs import RecoveryAction
from tenex_daemon.adapters.storage.filesystem.store import FileSystemStore, FsyncPolicy

__all__ = [
    "LOG_NAME",
    "STATE_NAME",
    "FileSystemStore",
    "FsyncPolicy",
    "IndexEntry",
    "LogScan",
    "RecoveryAction",
    "StoreLockedError",
    "encode_event",
    "encode_line",
    "scan_log",
]
