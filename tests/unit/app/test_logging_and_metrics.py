"""Structured logs (JSON lines with bound ids, secrets redacted) and Prometheus metrics."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest
import structlog

from tenex_daemon.app.logging import REDACTED, configure_logging, redact_secrets
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.core import nip19
from tenex_daemon.testing import KeyPair


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    """Parse every JSON line written so far."""
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_json_lines_carry_bound_ids_level_logger_and_time() -> None:
    """In JSON mode each line is an object with the contextvars ids, level, logger name and timestamp."""
    stream = io.StringIO()
    assert configure_logging("auto", "info", stream=stream) == "json"
    structlog.contextvars.bind_contextvars(conversation_id="c" * 64, event_id="e" * 64, agent="planner")
    structlog.get_logger("tenex_daemon.test").info("agent_run_started", attempt=1)
    structlog.get_logger("tenex_daemon.test").debug("hidden")
    [line] = lines(stream)
    assert line["event"] == "agent_run_started"
    assert line["conversation_id"] == "c" * 64
    assert line["event_id"] == "e" * 64
    assert line["agent"] == "planner"
    assert line["level"] == "info"
    assert line["logger"] == "tenex_daemon.test"
    assert "timestamp" in line


def test_secrets_are_redacted_and_public_keys_kept() -> None:
    """Secret-named fields, key-named 64-hex values and any nsec are redacted; pubkeys and ids stay."""
    stream = io.StringIO()
    configure_logging("json", "debug", stream=stream)
    keys = KeyPair.from_seed(7)
    nsec = nip19.encode_nsec(keys.secret)
    structlog.get_logger("t").info(
        "keys", pubkey=keys.pubkey, event_id="f" * 64, secret=keys.secret, key=keys.secret,
        agent_key=keys.secret, nested={"private": "x", "token": "y", "id": "z"}, note=f"leaked {nsec} here",
    )
    text = stream.getvalue()
    assert keys.secret not in text
    assert nsec not in text
    [line] = lines(stream)
    assert line["pubkey"] == keys.pubkey
    assert line["event_id"] == "f" * 64
    assert line["secret"] == line["key"] == line["agent_key"] == REDACTED
    assert line["nested"] == {"private": REDACTED, "token": REDACTED, "id": "z"}
    assert line["note"] == f"leaked nsec1{REDACTED} here"


def test_standard_library_loggers_go_through_the_same_renderer() -> None:
    """A stdlib logger's record becomes a JSON line with the bound ids, and is redacted too."""
    stream = io.StringIO()
    configure_logging("json", "info", stream=stream)
    structlog.contextvars.bind_contextvars(conversation_id="d" * 64)
    nsec = nip19.encode_nsec(KeyPair.from_seed(8).secret)
    logging.getLogger("aiohttp.test").warning("peer said %s", nsec)
    [line] = lines(stream)
    assert line["logger"] == "aiohttp.test"
    assert line["conversation_id"] == "d" * 64
    assert nsec not in json.dumps(line)


def test_console_format_and_bad_settings() -> None:
    """console mode renders plain text lines; an unknown format or level is a ValueError."""
    stream = io.StringIO()
    assert configure_logging("console", "info", stream=stream) == "console"
    structlog.get_logger("t").info("hello", agent="planner")
    assert "hello" in stream.getvalue()
    assert "agent=planner" in stream.getvalue()
    with pytest.raises(ValueError, match="log format"):
        configure_logging("xml", "info", stream=stream)
    with pytest.raises(ValueError, match="log level"):
        configure_logging("json", "loud", stream=stream)



def test_a_console_traceback_shows_no_local_variables() -> None:
    """In console format a logged exception's traceback leaves out its frames' local variables: they may
    hold what nothing else logs (a decrypted private message) and no processor sees them."""
    stream = io.StringIO()
    configure_logging("console", "info", stream=stream)

    def handle(content: str) -> None:
        raise RuntimeError("handler failed")

    private = "my bank PIN is " + str(4900 + 21)  # made at run time: the traceback's source lines show code
    try:
        handle(private)
    except RuntimeError:
        structlog.get_logger("t").exception("event handler failed")
    assert "handler failed" in stream.getvalue()
    assert private not in stream.getvalue()

def test_redact_processor_leaves_unrelated_fields_alone() -> None:
    """Fields that are not secret-like pass through unchanged."""
    event = {"event": "x", "kind": 11, "relay": "ws://127.0.0.1:7777", "pubkeys": ["a" * 64]}
    assert redact_secrets(None, "info", dict(event)) == event


def test_metrics_render_every_family_in_text_format() -> None:
    """Counters, the run histogram and the gauges appear in the exposition text with their labels."""
    metrics = Metrics()
    metrics.event_accepted(11)
    metrics.event_rejected("not_allowed")
    metrics.event_rejected("not_allowed")
    metrics.own_copy()
    metrics.reply_published("planner")
    metrics.agent_run_error("planner", "TimeoutError")
    metrics.observe_agent_run("planner", 0.02)
    metrics.set_runs_in_flight(2)
    metrics.set_relays([("ws://127.0.0.1:7777", True), ("wss://down.example", False)])
    text = metrics.render().decode()
    assert 'tenexd_events_accepted_total{kind="11"} 1.0' in text
    assert 'tenexd_events_rejected_total{reason="not_allowed"} 2.0' in text
    assert "tenexd_events_own_copies_total 1.0" in text
    assert 'tenexd_replies_published_total{agent="planner"} 1.0' in text
    assert 'tenexd_agent_run_errors_total{agent="planner",error="TimeoutError"} 1.0' in text
    assert 'tenexd_agent_run_seconds_count{agent="planner"} 1.0' in text
    assert "tenexd_runs_in_flight 2.0" in text
    assert 'tenexd_relay_connected{url="ws://127.0.0.1:7777"} 1.0' in text
    assert 'tenexd_relay_connected{url="wss://down.example"} 0.0' in text
    assert metrics.content_type.startswith("text/plain")


def test_routing_fallbacks_are_read_at_each_scrape_by_reason() -> None:
    """The routings the orchestrator's model did not decide are exported by reason, as counted when the
    scrape comes."""
    metrics = Metrics()
    counts = {"invalid_answer": 2}
    metrics.watch_routing(lambda: counts)
    first = metrics.render().decode()
    counts["backend_failed"] = 1
    second = metrics.render().decode()

    assert 'tenexd_routing_fallbacks_total{reason="invalid_answer"} 2.0' in first
    assert 'reason="backend_failed"' not in first
    assert 'tenexd_routing_fallbacks_total{reason="backend_failed"} 1.0' in second


def test_agent_run_context_times_counts_in_flight_and_errors() -> None:
    """agent_run() is in flight while inside, observes the duration and counts an escaping error."""
    metrics = Metrics()
    with metrics.agent_run("executor"):
        assert "tenexd_runs_in_flight 1.0" in metrics.render().decode()
    with pytest.raises(RuntimeError), metrics.agent_run("executor"):
        raise RuntimeError("backend down")
    text = metrics.render().decode()
    assert "tenexd_runs_in_flight 0.0" in text
    assert 'tenexd_agent_run_seconds_count{agent="executor"} 2.0' in text
    assert 'tenexd_agent_run_errors_total{agent="executor",error="RuntimeError"} 1.0' in text


def test_each_metrics_instance_has_its_own_registry() -> None:
    """Two Metrics objects never share counts (no global registry)."""
    first, second = Metrics(), Metrics()
    first.reply_published("planner")
    assert "replies_published_total{" not in second.render().decode()


SILENCED_WHILE_LOGGING = """
import structlog
from llama_cpp._utils import suppress_stdout_stderr

from tenex_daemon.app.logging import configure_logging

configure_logging("json", "info")
log = structlog.get_logger("tenex_daemon.test")
with suppress_stdout_stderr(disable=False):  # what llama-cpp-python does while a model loads
    for n in range(20):
        log.info("logged_while_silenced", n=n)
log.info("logged_after")
"""


def test_no_line_is_lost_while_a_library_points_stderr_at_dev_null() -> None:
    """Every line logged while llama-cpp-python's quiet mode has descriptors 1 and 2 on /dev/null reaches
    the daemon's stderr, in order (they all went to /dev/null, daemon_ready among them)."""
    done = subprocess.run(
        [sys.executable, "-c", SILENCED_WHILE_LOGGING], capture_output=True, text=True, timeout=120, check=True
    )
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert [(e["event"], e.get("n")) for e in events] == [
        *(("logged_while_silenced", n) for n in range(20)),
        ("logged_after", None),
    ]


def test_libraries_log_only_warnings_even_when_the_daemon_logs_at_debug() -> None:
    """At debug the daemon's own debug lines come out, a library's (websockets, httpx) do not, while its
    warnings still do (before, websockets wrote some 200,000 lines a day at debug, httpx one per model call
    at info)."""
    from tenex_daemon.app.logging import QUIET_LIBRARIES

    levels = {name: logging.getLogger(name).level for name in QUIET_LIBRARIES}
    stream = io.StringIO()
    try:
        configure_logging("json", "debug", stream=stream)
        structlog.get_logger("tenex_daemon.test").debug("own_debug")
        logging.getLogger("websockets.client").debug("= connection is OPEN")
        logging.getLogger("httpx").info("HTTP Request: POST http://model/v1/chat/completions")
        logging.getLogger("websockets.client").warning("a library warning")
        events = [line["event"] for line in lines(stream)]
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    assert events == ["own_debug", "a library warning"]
