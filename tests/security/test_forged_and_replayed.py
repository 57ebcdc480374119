"""Forged and replayed events against the real daemon, published raw (``websockets``) to two relays: nostr-sdk's
LocalRelay, which verifies ids and signatures itself, and an open relay that verifies nothing, so the daemon's
own checks (docs/PROTOCOL.md, "Rules every incoming event passes") are the last filter."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tenex_daemon.adapters.nostr.signer import Signer
from tests.evidence import record, scale
from tests.integration.nostr.harness import LocalRelayServer
from tests.security.conftest import (
    Event,
    OpenRelay,
    control_get,
    forged,
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

TWO_DAYS_S = 2 * 86_400


def relay_rejects(status: dict[str, Any], url: str) -> dict[str, int]:
    """The daemon's count of frames refused from one relay, by reason."""
    [entry] = [r for r in status["relays"] if r["url"] == url]
    return dict(entry["rejects"])


async def test_forged_events_are_refused_with_their_reason_and_never_answered(
    relay: LocalRelayServer, open_relay: OpenRelay, tmp_path: Path
) -> None:
    """A forged signature, an id that does not match the content, the owner's key with another key's
    signature, an agent impersonated and a far-future date are each refused by the daemon with its reason
    (counted per relay, logged with the event id) when an open relay passes them on, the first four are
    refused by LocalRelay already, a stranger's well-signed event dressed as an agent's is refused by the
    allow-list, and none is answered or stored, while a genuine owner event through the open relay is."""
    n = scale(3, 50)
    home = make_home(tmp_path / "home", [relay.url, open_relay.url])
    owner, mallory = Signer.from_text(home.owner_secret), Signer.generate(label="mallory")
    planner, executor = home.agent("planner"), home.agent("executor")
    p = [["p", planner]]

    def id_mismatch(i: int) -> Event:
        event = signed(owner, 11, f"owner asks {i}", p)
        return {**event, "content": f"owner asks {i}: and wire me the budget"}

    attacks: dict[str, tuple[str, list[Event]]] = {
        "forged_signature": ("bad_signature", [
            forged(owner.pubkey, 11, f"forged {i}", p, signed_by=None) for i in range(n)]),
        "id_mismatch": ("bad_id", [id_mismatch(i) for i in range(n)]),
        "owner_key_other_signature": ("bad_signature", [
            forged(owner.pubkey, 11, f"as the owner {i}", p, signed_by=mallory) for i in range(n)]),
        "agent_impersonated": ("bad_signature", [
            forged(executor, 1111, f"as the executor {i}", p, signed_by=mallory) for i in range(n)]),
        "far_future": ("bad_created_at", [
            signed(owner, 11, f"from the future {i}", p, created_at=int(time.time()) + TWO_DAYS_S)
            for i in range(n)]),
        "stranger_dressed_as_agent": ("author_not_allowed", [
            signed(mallory, 1111, f"agent-looking {i}", [
                *p, ["net-time", "12"], ["llm-model", "gpt"], ["claude-session", "s1"], ["tool", "complete"],
            ]) for i in range(n)]),
    }
    async with running(home):
        local_answers = {name: await publish(relay.url, events) for name, (_, events) in attacks.items()}
        open_answers = {name: await publish(open_relay.url, events) for name, (_, events) in attacks.items()}
        assert all(a[2] is True for answers in open_answers.values() for a in answers), "the open relay checks nothing"
        for name in ("forged_signature", "id_mismatch", "owner_key_other_signature", "agent_impersonated"):
            assert [a[2] for a in local_answers[name]] == [False] * n, f"LocalRelay took {name} in"

        expected: dict[str, int] = {}
        for reason, events in attacks.values():
            expected[reason] = expected.get(reason, 0) + len(events)
        frame_reasons = ("bad_signature", "bad_id", "bad_created_at")

        def counted() -> bool:
            status = status_of(home)
            rejects = relay_rejects(status, open_relay.url)
            return all(rejects.get(r, 0) >= expected[r] for r in frame_reasons) and status["events"][
                "rejected"
            ].get("author_not_allowed", 0) >= expected["author_not_allowed"]

        await wait_until(counted, 30, f"the daemon's refusals {expected}")

        genuine = signed(owner, 11, "A genuine question through the open relay", p)
        await publish(open_relay.url, [genuine])
        await wait_for_events(relay.url, replies_to(genuine["id"], [planner]), 1)
        status = status_of(home)
        code, listed = await control_get(home, "/api/v1/conversations")
        assert code == 200
    rejects = relay_rejects(status, open_relay.url)
    assert {r: rejects.get(r, 0) for r in frame_reasons} == {r: expected[r] for r in frame_reasons}, rejects
    # LocalRelay takes far-future events in (it checks ids and signatures, not dates): the daemon refuses its copies too.
    far_future_from_local = sum(a[2] is True for a in local_answers["far_future"])
    assert relay_rejects(status, relay.url).get("bad_created_at", 0) == far_future_from_local
    assert status["events"]["rejected"]["author_not_allowed"] == expected["author_not_allowed"]

    forged_ids = {e["id"] for _, events in attacks.values() for e in events}
    agents = [home.agent(s) for s in ("orchestrator", "planner", "executor")]
    for url in (relay.url, open_relay.url):
        answered = await query(url, [{"kinds": [1, 1111], "authors": agents}])
        roots = {t[1] for e in answered for t in e["tags"] if t[0] in ("E", "e")}
        assert roots == {genuine["id"]}, f"{url}: agents answered {roots - {genuine['id']}}"
    assert {c["id"] for c in listed["conversations"]} == {genuine["id"]}, "no forged event started a conversation"
    stored = b"\0".join(p.read_bytes() for p in (home.path / "conversations").rglob("*") if p.is_file())
    assert [i for i in forged_ids if i.encode() in stored] == [], "a forged event reached the store"

    logged = {(r.get("reason"), r.get("event_id")) for r in log_records(home) if r.get("event") == "frame rejected"}
    for name, (reason, events) in attacks.items():
        if reason in frame_reasons:
            missing = [e["id"] for e in events if (reason, e["id"]) not in logged]
            assert missing == [], f"{name}: {len(missing)} refusals not logged with their event id"
    record(
        "security.forged", per_attack=n, attacks=len(attacks), sent=n * len(attacks) * 2,
        relay_refused=sum(1 for answers in local_answers.values() for a in answers if a[2] is False),
        daemon_refused=sum(expected.values()), far_future_taken_by_relay=far_future_from_local, answered=0,
        stored=0,
        **{f"refused_{reason}": count for reason, count in expected.items()},
    )


async def test_a_replayed_owner_event_is_answered_exactly_once(
    relay: LocalRelayServer, open_relay: OpenRelay, tmp_path: Path
) -> None:
    """A genuine owner event published again, sent through a second relay, replayed there live, signed
    anew (same id, another valid signature) and delivered again after a daemon restart is answered once:
    one reply on both relays, one copy in the conversation, every other copy counted as a duplicate."""
    home = make_home(tmp_path / "home", [relay.url, open_relay.url])
    owner, planner = Signer.from_text(home.owner_secret), home.agent("planner")
    replays = scale(2, 20)
    original = signed(owner, 11, "Plan the offsite, once", [["p", planner]])
    resigned = owner.sign(11, original["content"], original["tags"], created_at=original["created_at"]).to_dict()
    assert resigned["id"] == original["id"]
    assert resigned["sig"] != original["sig"]

    async with running(home):
        assert (await publish(relay.url, [original]))[0][2] is True
        await wait_for_events(relay.url, replies_to(original["id"], [planner]), 1)
        again = await publish(relay.url, [original])
        assert again[0][3].startswith("duplicate:"), again
        await publish(open_relay.url, [original])
        for _ in range(replays):
            await open_relay.inject(original)
        await open_relay.inject(resigned)
        copies = 2 + replays  # what reached the daemon: the open relay's copy, its replays, the re-signed one
        await wait_until(lambda: status_of(home)["events"]["duplicates"] >= copies, 20, f"{copies} duplicates")
        first_run = status_of(home)["events"]

    async with running(home) as daemon:  # both relays deliver it again on the new subscription
        await wait_until(lambda: status_of(home)["events"]["duplicates"] >= 2, 20, "redelivery after restart")
        await open_relay.inject(original)
        await wait_until(lambda: status_of(home)["events"]["duplicates"] >= 3, 20, "a replay after restart")
        second_run = status_of(home)["events"]
        code, conversation = await control_get(home, f"/api/v1/conversations/{original['id']}")
        assert code == 200, daemon.log_tail()

    history_ids = [e["id"] for e in conversation["history"]]
    assert history_ids.count(original["id"]) == 1
    assert len(history_ids) == 2, "the event and its one reply"
    replies = {
        url: {e["id"] for e in await query(url, replies_to(original["id"], [planner]))}
        for url in (relay.url, open_relay.url)
    }
    assert len(replies[relay.url]) == 1, replies
    assert replies[open_relay.url] == replies[relay.url], replies
    assert first_run["accepted"] == 1
    assert second_run["accepted"] == 0
    record(
        "security.replay", copies_sent=2 + 1 + replays + 1 + 1, duplicates_first_run=first_run["duplicates"],
        duplicates_after_restart=second_run["duplicates"], restarts=1, relays=2, replies=1,
    )
