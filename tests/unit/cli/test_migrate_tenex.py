"""``tenexd migrate --from DIR`` end to end on TENEX conversation files of odd shapes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tenex_daemon.core.events import NostrEvent
from tenex_daemon.testing import sign_event
from tests.unit.cli.conftest import USER, tenexd


def conversation(root: NostrEvent, **parts: Any) -> dict[str, Any]:
    """A TENEX conversation file's object: ``root`` as its history, with ``parts`` added."""
    history = [json.dumps([0, root.pubkey, root.created_at, root.kind, root.tags, root.content, root.sig, root.id])]
    return {"id": root.id, "title": root.content, "phase": "chat", "history": history, **parts}


def test_migrate_from_tenex_imports_every_file_around_odd_ones(home: Path, tmp_path: Path) -> None:
    """Files with an odd side field are imported with a note, one whose history is not a list is the one
    failure (exit 1), the files after them are imported, and a rerun stops nowhere either: before, the
    command ended in an AttributeError traceback at the first odd file, every time."""
    folder = tmp_path / "project" / ".tenex" / "conversations"
    folder.mkdir(parents=True)
    roots = [sign_event(USER, f"question {n}", kind=11, created_at=1_700_000_000 + n) for n in range(5)]
    files = [
        conversation(roots[0]),
        conversation(roots[1], agentStates=[["alice", {"lastProcessedMessageIndex": 1}]]),
        conversation(roots[2], executionTime=42, phaseTransitions=["chat->execute"]),
        {**conversation(roots[3]), "history": "not a list"},
        conversation(roots[4]),
    ]
    for n, data in enumerate(files):
        (folder / f"{n:02d}.json").write_text(json.dumps(data))

    code, out = tenexd(home, "migrate", "--from", str(tmp_path / "project"), "--json")

    assert code == 1, out
    report = json.loads(out)
    assert report["imported"] == [roots[n].id for n in (0, 1, 2, 4)]
    assert [(Path(p["path"]).name, p["reason"]) for p in report["failed"]] == [
        ("03.json", "ValueError: history is a string, not a list"),
    ]
    assert sorted(p["reason"] for p in report["notes"]) == [
        "agentStates left out: it is a list, not an object",
        "executionTime left out: it is a number, not an object",
        "phaseTransitions[0] left out: it is a string, not an object",
    ]
    code, out = tenexd(home, "migrate", "--from", str(tmp_path / "project"), "--json")
    assert code == 1, out
    assert json.loads(out)["already_present"] == report["imported"]


def test_migrate_from_tenex_ends_only_what_is_idle_past_the_homes_own_timeout(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TENEX conversation whose last message is two hours old comes in open in a home whose idle timeout is
    ten hours, as the daemon would keep it: the command hands the importer the home's timeout, not the
    30-minute default."""
    folder = tmp_path / "project" / ".tenex" / "conversations"
    folder.mkdir(parents=True)
    root = sign_event(USER, "question", kind=11, created_at=int(time.time()) - 2 * 3600)
    (folder / "00.json").write_text(json.dumps(conversation(root)))
    monkeypatch.setenv("TENEX_CONVERSATIONS__IDLE_TIMEOUT_MIN", "600")

    code, out = tenexd(home, "migrate", "--from", str(tmp_path / "project"), "--json")

    assert code == 0, out
    _, shown = tenexd(home, "conversations", "show", root.id, "--json")
    assert json.loads(shown)["ended_at"] is None
