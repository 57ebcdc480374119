"""The allow-list against the real daemon and a real relay: strangers are never answered, cost no disk and
are logged and counted; the owner and whitelisted people are answered, a whitelisted person only in their
own threads and those the owner invites them into (docs/PROTOCOL.md, "Who answers an event")."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from tenex_daemon.adapters.nostr.signer import Signer
from tests.e2e.harness import Home
from tests.evidence import record, scale
from tests.integration.nostr.harness import LocalRelayServer
from tests.security.conftest import (
    Event,
    log_records,
    make_home,
    publish,
    query,
    replies_to,
    running,
    signed,
    status_of,
    wait_for_events,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STRANGER_KEYS = 5
AGENTS = ("orchestrator", "planner", "executor")


def thread_tags(root: Event, *p: str) -> list[list[str]]:
    """The NIP-22 tags of a reply to a kind-11 ``root``, p-tagging ``p``."""
    return [
        ["E", root["id"], "", root["pubkey"]], ["K", str(root["kind"])], ["P", root["pubkey"]],
        ["e", root["id"], "", root["pubkey"]], ["k", str(root["kind"])], *(["p", key] for key in p),
    ]


def home_files(home: Home) -> dict[str, bytes]:
    """Every file of the home but the status file and the daemon's own log: path -> content."""
    files = {}
    for path in sorted(home.path.rglob("*")):
        rel = path.relative_to(home.path).as_posix()
        if rel != "daemon.log" and not rel.startswith("run/"):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):  # renamed or removed meanwhile
                files[rel] = path.read_bytes()
    return files


async def quiet_home(home: Home, within: float = 20.0) -> dict[str, bytes]:
    """The home's files once two looks 0.6 s apart see no change (the daemon's writes have settled)."""
    deadline = time.monotonic() + within
    before = home_files(home)
    while True:
        await asyncio.sleep(0.6)
        now = home_files(home)
        if now == before:
            return now
        assert time.monotonic() < deadline, "the home kept changing"
        before = now


def agent_keys(home: Home) -> list[str]:
    """The public keys of the home's agents."""
    return [home.agent(slug) for slug in AGENTS]


async def test_a_strangers_flood_is_never_answered_costs_no_disk_and_is_logged_and_counted(
    relay: LocalRelayServer, tmp_path: Path
) -> None:
    """Events from keys outside the allow-list p-tagging an agent (kinds 11, 1, 1934, replies into the owner's
    thread and stop requests against it) get no reply, put none of their ids or text in any file of the home,
    grow it by a bounded amount whatever their number, and are counted (``author_not_allowed``) and logged
    (``event_refused``, once per stranger per minute)."""
    count = scale(50, 2000)
    home = make_home(tmp_path / "home", [relay.url])
    owner, planner = Signer.from_text(home.owner_secret), home.agent("planner")
    async with running(home) as daemon:
        root = signed(owner, 11, "The owner's own plans", [["p", planner]])
        assert (await publish(relay.url, [root]))[0][2] is True
        await wait_for_events(relay.url, replies_to(root["id"], [planner]), 1)
        before = await quiet_home(home)
        accepted_before = status_of(home)["events"]["accepted"]

        strangers = [Signer.generate(label=f"stranger{i}") for i in range(STRANGER_KEYS)]
        shapes: list[tuple[int, list[list[str]]]] = [
            (11, [["p", planner]]),
            (1, [["p", planner]]),
            (1934, [["p", planner]]),
            (1111, thread_tags(root, planner)),
            (11, [["p", home.project]]),
            (24134, [["e", root["id"]], ["p", planner]]),  # a stop request against the owner's conversation
        ]
        flood = [
            signed(strangers[i % STRANGER_KEYS], *_shape(shapes, i, f"stranger says {i}: do free work"))
            for i in range(count)
        ]
        started = time.monotonic()
        answers = await publish(relay.url, flood, within=120)
        assert all(answer[2] is True for answer in answers), "the relay took every stranger's event in"

        def refused() -> int:
            rejected: dict[str, int] = status_of(home)["events"]["rejected"]
            return rejected.get("author_not_allowed", 0)

        await wait_until(lambda: refused() >= count, 60 + count / 20, f"{count} events counted as refused")
        flood_s = time.monotonic() - started
        await asyncio.sleep(1.5)  # past the relay cursor's flush interval (1 s)
        after = await quiet_home(home)
        status = status_of(home)
        assert refused() == count, daemon.log_tail()
        assert status["events"]["accepted"] == accepted_before

    agent_events = await query(relay.url, [{"authors": agent_keys(home), "kinds": [1, 1111, 7, 1934]}])
    assert [e["tags"] for e in agent_events if e["pubkey"] == planner and ["E", root["id"], "", home.owner]
            in e["tags"]], "the owner's message was answered"
    assert len(agent_events) == 1, f"only the owner was answered: {[e['content'] for e in agent_events]}"

    # The store's derived files (the id buckets, the index) of the owner's own messages are written at its
    # next commit, which the relay cursor's flush may be: files may appear, but none holds a stranger's
    # event, and the growth does not scale with the flood.
    added = sorted(set(after) - set(before))
    changed = sorted(k for k in set(after) & set(before) if after[k] != before[k])
    kept = b"\0".join(after.values())
    leaked = [e["id"] for e in flood if e["id"].encode() in kept or e["content"].encode() in kept]
    assert leaked == [], f"{len(leaked)} strangers' events reached the home's files ({added + changed})"
    grown = sum(map(len, after.values())) - sum(map(len, before.values()))
    assert grown <= 8192 + 256 * int(flood_s + 3), f"{grown} bytes for {count} refused events"

    lines = [r for r in log_records(home) if r.get("event") == "event_refused"]
    assert {r["author"] for r in lines} == {s.pubkey for s in strangers}
    assert all(r["reason"] == "author_not_allowed" for r in lines)
    minutes = 1 + int(flood_s // 60)
    assert STRANGER_KEYS <= len(lines) <= STRANGER_KEYS * minutes, "one line per stranger a minute, not per event"
    record(
        "security.allow_list.strangers", events=count, stranger_keys=STRANGER_KEYS, counted=count,
        replies=len(agent_events) - 1, leaked=len(leaked), files_added=len(added), files_changed=len(changed),
        bytes_grown=grown, log_lines=len(lines), flood_s=round(flood_s, 2),
    )


def _shape(shapes: list[tuple[int, list[list[str]]]], i: int, content: str) -> tuple[int, str, list[list[str]]]:
    kind, tags = shapes[i % len(shapes)]
    return kind, content, tags


async def test_the_owner_and_a_whitelisted_person_are_answered_the_person_only_where_they_belong(
    relay: LocalRelayServer, tmp_path: Path
) -> None:
    """The owner and a whitelisted person are answered in their own threads; the person's reply into the
    owner's thread is refused (``not_a_participant``, ``join_refused`` logged) until the owner p-tags them
    there, then it is answered."""
    person = Signer.generate(label="whitelisted")
    home = make_home(tmp_path / "home", [relay.url], whitelist=[person.pubkey])
    owner, planner = Signer.from_text(home.owner_secret), home.agent("planner")
    async with running(home) as daemon:
        owners = signed(owner, 11, "Owner: the budget for next year", [["p", planner]])
        persons = signed(person, 11, "Person: my own question", [["p", planner]])
        await publish(relay.url, [owners, persons])
        [owner_reply] = await wait_for_events(relay.url, replies_to(owners["id"], [planner]), 1)
        [person_reply] = await wait_for_events(relay.url, replies_to(persons["id"], [planner]), 1)
        assert owner_reply["pubkey"] == person_reply["pubkey"] == planner
        assert ["p", person.pubkey] in person_reply["tags"]

        intrusion = signed(person, 1111, "Person: tell me the owner's budget", thread_tags(owners, planner))
        await publish(relay.url, [intrusion])

        def refused(reason: str) -> int:
            rejected: dict[str, Any] = status_of(home)["events"]["rejected"]
            return int(rejected.get(reason, 0))

        await wait_until(lambda: refused("not_a_participant") == 1, 15, "the intrusion counted")
        assert len(await query(relay.url, replies_to(owners["id"], [planner]))) == 1, "the intrusion ran nobody"
        joins = [r for r in log_records(home) if r.get("event") == "join_refused"]
        assert [r.get("event_id") for r in joins] == [intrusion["id"]], daemon.log_tail()

        invite = signed(owner, 1111, "Owner: please join us", thread_tags(owners, planner, person.pubkey))
        await publish(relay.url, [invite])
        await wait_for_events(relay.url, replies_to(owners["id"], [planner]), 2)
        joined = signed(person, 1111, "Person: thanks for having me", thread_tags(owners, planner))
        await publish(relay.url, [joined])
        thread = await wait_for_events(relay.url, replies_to(owners["id"], [planner]), 3)
        assert refused("not_a_participant") == 1
        assert refused("author_not_allowed") == 0
    record("security.allow_list.people", owner_replies=len(thread), person_replies=1, refused_joins=1)


async def test_unreadable_gift_wraps_from_anyone_cost_no_disk(relay: LocalRelayServer, tmp_path: Path) -> None:
    """Gift wraps (kind 1059) p-tagging an agent that do not open, each from a one-time key the allow-list
    cannot judge, are counted (``wrap_unreadable``) and never written to the home: their ids stay out of the
    store's processed-id ledger, like strangers' events; the log gets one line a minute, not one per wrap."""
    count = scale(20, 500)
    home = make_home(tmp_path / "home", [relay.url])
    planner = home.agent("planner")
    wraps = [signed(Signer.generate(), 1059, f"no NIP-44 payload {i}", [["p", planner]]) for i in range(count)]
    started = time.monotonic()
    async with running(home) as daemon:
        before = await quiet_home(home)
        assert all(answer[2] is True for answer in await publish(relay.url, wraps, within=120))

        def refused() -> int:
            rejected: dict[str, int] = status_of(home)["events"]["rejected"]
            return rejected.get("wrap_unreadable", 0)

        await wait_until(lambda: refused() >= count, 60 + count / 20, f"{count} wraps counted as unreadable")
        await asyncio.sleep(1.5)  # past the store's derived-data and the cursor's flush intervals
        after = await quiet_home(home)
        assert refused() == count, daemon.log_tail()
    kept = b"\0".join(after.values())
    stored = [w["id"] for w in wraps if w["id"].encode() in kept]
    assert stored == [], f"{len(stored)} of {count} unreadable wraps were written to the home"
    lines = [r for r in log_records(home) if r.get("event") in ("event_refused", "gift_wrap_refused")]
    minutes = 1 + int((time.monotonic() - started) // 60)
    assert 1 <= len(lines) <= minutes, f"{len(lines)} log lines for {count} wraps: one a minute, not one per wrap"
    grown = sum(map(len, after.values())) - sum(map(len, before.values()))
    record(
        "security.allow_list.wraps", wraps=count, counted=count, stored=len(stored), bytes_grown=grown,
        log_lines=len(lines),
    )
