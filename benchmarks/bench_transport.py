"""Benchmark: the Nostr receive path next to raw Schnorr verification of the same events (issue 4).

For N signed events (default 5,000, from 50 authors, realistic reply tags and
content), it times, in the same run and interleaved round by round:
- raw verify: coincurve ``PublicKeyXOnly.verify`` on pre-decoded bytes with
  pre-built key objects: the cryptographic floor, nothing else;
- full receive path: raw relay frame text -> ``parse_relay_frame`` (JSON parse and
  NIP-01 shape in one pydantic-core pass, size limits, id recomputed, Schnorr
  signature with the cached key) -> in-memory dedupe (``SeenIds``), i.e. everything
  a relay reader does before an event is queued for the consumer.
It also times non-crypto stages alone (the full path does parse and shape in one
pass, so its cost is below their sum), to show where the rest goes.
The ratio is full-path events/s over raw-verify events/s. Target: >= 0.7.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import pydantic_core
from coincurve import PrivateKey, PublicKeyXOnly

from benchmarks.common import emit_figures, print_table
from tenex_daemon.adapters.nostr.codec import (
    EventMessage,
    PublicKeyCache,
    event_id_digest,
    parse_relay_frame,
)
from tenex_daemon.adapters.nostr.relay_pool import SeenIds
from tenex_daemon.core.events import NostrEvent

TARGET = 0.7


def make_frames(count: int, authors: int) -> tuple[list[str], list[NostrEvent]]:
    """Return ``count`` EVENT frames (as a relay sends them) and their events."""
    secrets = [PrivateKey() for _ in range(authors)]
    pubkeys = [PublicKeyXOnly.from_secret(k.secret).format().hex() for k in secrets]
    frames: list[str] = []
    events: list[NostrEvent] = []
    for n in range(count):
        i = n % authors
        tags = [["E", "ab" * 32, "", pubkeys[0]], ["K", "11"], ["P", pubkeys[0]],
                ["e", "cd" * 32, "", pubkeys[i]], ["k", "1111"], ["p", pubkeys[(i + 1) % authors]]]
        content = f"message {n}: " + "the quick brown fox jumps over the lazy dog ✨ " * (1 + n % 6)
        created_at = 1_700_000_000 + n
        digest = event_id_digest(pubkeys[i], created_at, 1111, tags, content)
        sig = secrets[i].sign_schnorr(digest, os.urandom(32))
        event = NostrEvent(id=digest.hex(), pubkey=pubkeys[i], created_at=created_at, kind=1111,
                           tags=tags, content=content, sig=sig.hex())
        events.append(event)
        frames.append(json.dumps(["EVENT", "mentions", event.to_dict()], ensure_ascii=False,
                                 separators=(",", ":")))
    return frames, events


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--events", type=int, default=5_000)
    parser.add_argument("--authors", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    frames, events = make_frames(args.events, args.authors)
    keys = {e.pubkey: PublicKeyXOnly(bytes.fromhex(e.pubkey)) for e in events}
    raw = [(keys[e.pubkey], bytes.fromhex(e.sig), bytes.fromhex(e.id)) for e in events]
    parsed = [json.loads(f)[2] for f in frames]

    def raw_verify() -> None:
        for key, sig, msg in raw:
            if not key.verify(sig, msg):
                raise AssertionError("raw verify failed")

    def full_path() -> None:
        cache = PublicKeyCache()
        seen = SeenIds(100_000)
        for frame in frames:
            message = parse_relay_frame(frame, key_cache=cache)
            if not isinstance(message, EventMessage) or not seen.add_if_new(message.event.id):
                raise AssertionError("full path refused a good event")

    def json_only() -> None:
        for frame in frames:
            pydantic_core.from_json(frame)

    def shape_only() -> None:
        for data in parsed:
            NostrEvent.model_validate(data)

    def id_only() -> None:
        for d in parsed:
            event_id_digest(d["pubkey"], d["created_at"], d["kind"], d["tags"], d["content"])

    timed: dict[str, Callable[[], None]] = {
        "raw coincurve verify": raw_verify,
        "full receive path": full_path,
        "  stage: JSON parse alone": json_only,
        "  stage: model_validate alone": shape_only,
        "  stage: id hash alone": id_only,
    }
    samples: dict[str, list[float]] = {name: [] for name in timed}
    full_path()  # warm up imports and caches once
    for _ in range(args.rounds):
        for name, fn in timed.items():  # interleaved, so machine noise hits every path alike
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    rate = {name: args.events / m for name, m in medians.items()}
    rows = [(name, f"{rate[name]:,.0f}", f"{medians[name] / args.events * 1e6:.1f}") for name in timed]
    ratio = rate["full receive path"] / rate["raw coincurve verify"]
    print_table(
        f"Nostr receive path, {args.events:,} events from {args.authors} authors, "
        f"median of {args.rounds} rounds",
        ("path", "events/s", "us/event"), rows,
    )
    verdict = "meets" if ratio >= TARGET else "BELOW"
    print(f"ratio full path / raw verify: {ratio:.2f} ({verdict} target >= {TARGET})")
    figures: dict[str, float | None] = {f"{name.strip()}: events/s": rate[name] for name in timed}
    figures["ratio full path / raw verify"] = ratio
    emit_figures("transport", figures)


if __name__ == "__main__":
    main()
