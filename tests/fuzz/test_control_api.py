"""The control API fuzzed from its own OpenAPI document (schemathesis), against a real ``tenexd run``.

The daemon runs as a subprocess on a fresh home with its loopback TCP port on (``control.tcp_port``), a
real relay, and conversations the owner started through that relay (a thread, a task, a note), so that
generated cases hit real conversations as well as unknown and malformed ids. The document is loaded from
the daemon itself (``GET /api/v1/openapi.json``); every operation is fuzzed with valid (positive) and
invalid (negative) data, with the token, and again without it or with a wrong one, another Host or another
origin. No answer is a 5xx, the guard answers 401/403 before any handler, and the daemon is still running
afterwards with no ``control_api_error`` in its log.

``scale`` sizes it: a dozen cases per operation and mode under ``scripts/test``, over a hundred under
``scripts/faults`` (``TENEX_FAULTS_FULL=1``); each test records its figures.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest
import requests
import schemathesis
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.schemas import OpenApiSchema
from websockets.asyncio.client import connect

from tenex_daemon import ConversationManager, MemoryStore
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app.control.paths import CONVERSATIONS, OPENAPI, STATUS
from tenex_daemon.app.control.routes import create_app
from tenex_daemon.app.metrics import Metrics
from tests.e2e.harness import DaemonProcess, Home, make_home
from tests.evidence import record, scale
from tests.integration.nostr.harness import LocalRelayServer, free_port

PER_OPERATION: Final = scale(12, 200)
"""Hypothesis examples per operation and mode (positive, negative, junk, each parameter), with the token."""
UNAUTHENTICATED: Final = scale(3, 25)
"""Hypothesis examples per operation and each way of asking without the right credentials."""
OPERATIONS: Final = 14
"""Operations the document names (13 paths; one of them has GET and DELETE)."""


@dataclass
class Served:
    """The running daemon, its TCP base URL and token, and the ids of what the owner started."""

    daemon: DaemonProcess
    base: str
    token: str
    conversations: list[str]
    task: str
    port: int

    @property
    def auth(self) -> dict[str, str]:
        """The header the TCP port asks for."""
        return {"Authorization": f"Bearer {self.token}"}

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        """GET ``path`` with the token."""
        return requests.get(self.base + path, headers=self.auth, timeout=10, **kwargs)


async def _publish(url: str, events: list[dict[str, Any]]) -> None:
    """Send each event to the relay and wait for its OK."""
    async with asyncio.timeout(30), connect(url) as ws:
        for event in events:
            await ws.send(json.dumps(["EVENT", event]))
            while True:
                frame = json.loads(await ws.recv())
                if frame[0] == "OK":
                    assert frame[2] is True, frame
                    break


def _seed(relay: LocalRelayServer, home: Home, served: Served) -> None:
    """The owner starts a thread with the planner (and replies in it), a task for the executor and a note to
    the orchestrator; wait until the daemon stored the three conversations and the planner answered."""
    owner = Signer.from_text(home.owner_secret)
    thread = owner.sign(11, "Plan a picnic", [["p", home.agent("planner")], ["title", "Picnic"]])
    task = owner.sign(1934, "Book the park", [["p", home.agent("executor")]])
    note = owner.sign(1, "Anyone there?", [["p", home.agent("orchestrator")]])
    reply = owner.sign(1111, "And drinks?", [["E", thread.id, "", owner.pubkey], ["K", "11"],
                                             ["e", thread.id], ["p", home.agent("planner")]])
    asyncio.run(_publish(relay.url, [e.to_dict() for e in (thread, task, note, reply)]))
    served.conversations = [thread.id, note.id]
    served.task = task.id
    for _ in range(300):
        found = served.get("/api/v1/conversations").json()
        rows = {row["id"]: row for row in found.get("conversations", [])}
        if {thread.id, task.id, note.id} <= set(rows) and rows[thread.id]["event_count"] >= 3:
            return
        time.sleep(0.1)
    raise AssertionError(f"the daemon did not take the owner's events in:\n{served.daemon.log_tail()}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """``tenexd run`` on a fresh home with a real relay and the control API on a loopback TCP port."""
    root: Path = tmp_path_factory.mktemp("control-api")
    relay = LocalRelayServer(root / "relay-lmdb")
    port = free_port()
    home = make_home(root / "home", relay.url)
    daemon = DaemonProcess(home, env={"TENEX_CONTROL__TCP_PORT": str(port)})
    try:
        asyncio.run(relay.start())
        asyncio.run(daemon.start())
        token = (home.path / "run" / "control.token").read_text(encoding="ascii").strip()
        the_served = Served(daemon, f"http://127.0.0.1:{port}", token, [], "", port)
        _seed(relay, home, the_served)
        yield the_served
    finally:
        try:
            if daemon.proc is not None:
                asyncio.run(daemon.stop())
        finally:
            daemon.kill()
            relay.stop()


@pytest.fixture(scope="module")
def schema(served: Served) -> OpenApiSchema:
    """The daemon's own OpenAPI document, as it serves it (loaded from its JSON: ``from_url`` would leave out
    the document's own operation)."""
    document = served.get(OPENAPI)
    assert document.status_code == 200
    return schemathesis.openapi.from_dict(document.json())


Operation = APIOperation[Any, Any, Any, Any]
AnyCase = Case[Operation]


def operations(schema: OpenApiSchema) -> list[Operation]:
    """Every operation of the document, the destructive DELETE last (the others then meet real ids)."""
    found: list[Operation] = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result
        found.append(result.ok())
    return sorted(found, key=lambda op: (op.method.upper() == "DELETE", op.path, op.method))


def _fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck),
    )


KNOWN_AGENTS: Final = ["planner", "executor", "orchestrator"]


def _aim(case: AnyCase, served: Served, pick: int) -> None:
    """Point some cases at what exists: a real conversation or task id, a real agent slug."""
    ids = [*served.conversations, served.task]
    if pick < len(ids) and case.path_parameters is not None and "id" in case.path_parameters:
        case.path_parameters["id"] = ids[pick]
    if pick < len(KNOWN_AGENTS) and case.query is not None and "agent" in case.query:
        case.query["agent"] = KNOWN_AGENTS[pick]


def _label(operation: Operation) -> str:
    return f"{operation.method.upper()} {operation.path}"


def _has_inputs(operation: Operation) -> bool:
    """Whether the operation declares anything to send wrong (schemathesis negates only declared inputs)."""
    return bool(len(operation.path_parameters) or len(operation.query) or len(operation.body))


def _nested(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20), _nested,
    max_leaves=10,
)
junk_bodies = st.one_of(
    st.none(),
    st.binary(max_size=300),
    st.text(max_size=200).map(lambda text: text.encode("utf-8", "surrogatepass")),
    json_values.map(lambda value: json.dumps(value).encode()),
    st.sampled_from(["id", "all", "since", "reason", "agent", "keep_system_message"]).flatmap(
        lambda key: json_values.map(lambda value: json.dumps({key: value}).encode())
    ),
    st.integers(1, 200_000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.integers(60_000, 200_000).map(lambda size: b'{"reason": "' + b"x" * size + b'"}'),
)
"""Request bodies of any bytes: not JSON, not UTF-8, JSON of any shape, the known fields with any value,
nested past the decoder's recursion, larger than the API's 64 KiB limit."""
LOOKALIKE_DIGITS: Final = "0123456789²³¹⁰⁴⁹½¼٣١٠２５۵߀᠐Ⅻ"
"""ASCII digits and others: superscripts, fractions, Arabic-Indic, full-width, N'Ko, Mongolian, Roman."""
number_like = st.one_of(
    st.text(st.sampled_from(LOOKALIKE_DIGITS), min_size=1, max_size=4),
    st.text(st.characters(categories=["Nd", "No", "Nl"]), min_size=1, max_size=4),
) | st.sampled_from(
    ["1e400", "-1", "0", "10001", "99999999999999999999", "nan", "inf", "1_000", "0x10", " 5", "2026-13-45",
     "2026-02-30T25:61", "9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00+14:00", "0001-01-01", "9999-12-31",
     "-62135596800", "253402300800", "npub1x", "true", "ON"]
)
"""Values that look like numbers, dates or booleans to someone (digits of every script, superscripts)."""
QUERY_NAMES: Final = ["title", "phase", "archived", "date_from", "date_to", "from", "to", "participant", "limit",
                      "agent", "trigger"]


def junk_queries(operation: Operation) -> st.SearchStrategy[dict[str, str]]:
    """Query parameters: the operation's own (most often) and any others, with any text or number-like values."""
    declared = sorted({parameter.name for parameter in operation.query}) or QUERY_NAMES
    values = number_like | number_like | st.text(max_size=30)
    anything = st.sampled_from(QUERY_NAMES) | st.text(min_size=1, max_size=10)
    return st.one_of(
        st.builds(lambda name, value: {name: value}, st.sampled_from(declared), values),  # one, checked alone
        st.dictionaries(st.sampled_from(declared), values, max_size=3),
        st.dictionaries(anything, values, max_size=4),
    )
content_types = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""])


@dataclass
class Answers:
    """What the fuzzed cases got: statuses, cases per operation and mode, and any 5xx."""

    statuses: Counter[str] = field(default_factory=Counter)
    per_operation: Counter[str] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)

    def note(self, operation: Operation, mode: str, status: int, text: str, shown: str) -> None:
        """Count one answer; fail on a 5xx, naming the request."""
        self.statuses[f"{status // 100}xx"] += 1
        self.statuses["cases"] += 1
        self.per_operation[f"{_label(operation)} {mode}"] += 1
        if status >= 500:
            self.server_errors.append(f"{shown} -> {status} {text[:200]}")
        assert status < 500, self.server_errors[-1]

    def count(self, mode: str) -> int:
        """Cases sent in one mode."""
        return sum(n for key, n in self.per_operation.items() if key.endswith(f" {mode}"))


def fuzz_generated(served: Served, operation: Operation, mode: GenerationMode, answers: Answers) -> None:
    """schemathesis's cases for the operation in ``mode``, with the token (positive ones aimed at times)."""
    session = requests.Session()

    @_fuzz(PER_OPERATION)
    @given(case=operation.as_strategy(generation_mode=mode), pick=st.integers(0, 5))
    def fuzz(case: AnyCase, pick: int) -> None:
        if mode is GenerationMode.POSITIVE:
            _aim(case, served, pick)
        response = case.call(base_url=served.base, session=session, headers=served.auth, timeout=30)
        answers.note(operation, mode.value, response.status_code, response.text, case.as_curl_command())

    fuzz()


def fuzz_junk(served: Served, operation: Operation, answers: Answers) -> None:
    """The operation's valid cases with any extra query parameters and any raw body, with the token."""
    session = requests.Session()

    @_fuzz(PER_OPERATION)
    @given(
        case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE), pick=st.integers(0, 5),
        query=junk_queries(operation), merge=st.booleans(), body=junk_bodies, content_type=content_types,
    )
    def fuzz(
        case: AnyCase, pick: int, query: dict[str, str], merge: bool, body: bytes | None, content_type: str
    ) -> None:
        _aim(case, served, pick)
        request = case.as_transport_kwargs(base_url=served.base, headers=served.auth)
        request.pop("json", None)
        # added to the case's own parameters, or in their place (alone, a parameter is checked for itself)
        request["params"] = {**(request.get("params") or {}), **query} if merge else query
        if body is not None:
            request["data"] = body
            request["headers"] = {**request["headers"], "Content-Type": content_type}
        response = session.request(**request, timeout=30)
        shown = f"{request['method']} {request['url']} params={request['params']!r} body={body!r:.100}"
        answers.note(operation, "junk", response.status_code, response.text, shown)

    fuzz()


def fuzz_parameters(served: Served, operation: Operation, answers: Answers) -> None:
    """Each declared query parameter alone (with the required ones of the case) given number-like, date-like
    or any text: every parameter's own parser meets the values it was not written for."""
    declared = sorted(parameter.name for parameter in operation.query)
    required = {parameter.name for parameter in operation.query if parameter.is_required}
    session = requests.Session()

    @_fuzz(PER_OPERATION)
    @given(
        case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE), pick=st.integers(0, 5),
        name=st.sampled_from(declared), value=number_like | st.text(max_size=30),
    )
    def fuzz(case: AnyCase, pick: int, name: str, value: str) -> None:
        _aim(case, served, pick)
        request = case.as_transport_kwargs(base_url=served.base, headers=served.auth)
        kept = {key: v for key, v in (request.get("params") or {}).items() if key in required}
        request["params"] = {**kept, name: value}
        response = session.request(**request, timeout=30)
        shown = f"{request['method']} {request['url']} params={request['params']!r}"
        answers.note(operation, "parameter", response.status_code, response.text, shown)

    fuzz()


@pytest.mark.integration
@pytest.mark.slow
def test_every_operation_fuzzed_from_the_document_never_answers_5xx(served: Served, schema: OpenApiSchema) -> None:
    """Every operation of the daemon's own OpenAPI document, sent with the token schemathesis's valid
    (positive) and invalid (negative) path ids, query parameters and bodies (some aimed at the owner's real
    conversations, task and agents), then any extra query parameters and raw bodies (not JSON, nested deep,
    over the size limit), and each query parameter alone with number- and date-like values of any script,
    is answered below 500, and the daemon keeps running."""
    ops = operations(schema)
    assert len(ops) == OPERATIONS, "; ".join(_label(op) for op in ops)
    answers = Answers()
    for operation in ops:
        fuzz_generated(served, operation, GenerationMode.POSITIVE, answers)
        if _has_inputs(operation):
            fuzz_generated(served, operation, GenerationMode.NEGATIVE, answers)
        fuzz_junk(served, operation, answers)
        if len(operation.query):
            fuzz_parameters(served, operation, answers)

    assert not answers.server_errors
    assert served.daemon.proc is not None
    assert served.daemon.proc.poll() is None, "the daemon exited"
    assert served.get(STATUS).json()["state"] == "running"
    assert answers.statuses["2xx"] > 0
    assert answers.statuses["4xx"] > 0
    for operation in ops:
        assert answers.per_operation[f"{_label(operation)} positive"] > 0, _label(operation)
        assert answers.per_operation[f"{_label(operation)} junk"] > 0, _label(operation)
    record(
        "fuzz.control_api",
        operations=len(ops),
        cases=answers.statuses["cases"],
        positive=answers.count("positive"),
        negative=answers.count("negative"),
        junk=answers.count("junk"),
        parameter=answers.count("parameter"),
        status_2xx=answers.statuses["2xx"],
        status_4xx=answers.statuses["4xx"],
        server_errors=len(answers.server_errors),
        crashes=0,
    )


CREDENTIALS: Final[dict[str, tuple[dict[str, str], int]]] = {
    # name: (headers replacing the good ones, the status the guard must answer)
    "no_token": ({}, 401),
    "wrong_token": ({"Authorization": "Bearer " + "x" * 43}, 401),
    "not_bearer": ({"Authorization": "Basic dXNlcjpwYXNz"}, 401),
    "empty_bearer": ({"Authorization": "Bearer "}, 401),
}
WAYS: Final = [*CREDENTIALS, "other_host", "cross_origin", "cross_site_fetch"]


def _credentials(served: Served, way: str) -> tuple[dict[str, str], int]:
    """The headers of one wrong way to ask, and the status the guard answers it with."""
    if way in CREDENTIALS:
        return CREDENTIALS[way]
    if way == "other_host":
        return {**served.auth, "Host": f"evil.example:{served.port}"}, 403
    if way == "cross_origin":
        return {**served.auth, "Origin": "http://evil.example"}, 403
    return {**served.auth, "Sec-Fetch-Site": "cross-site"}, 403


def fuzz_unauthenticated(served: Served, operation: Operation, way: str, tally: Counter[str]) -> None:
    """The operation's generated cases (valid and invalid) asked one wrong way: each is refused by the guard."""
    session = requests.Session()
    headers, expected = _credentials(served, way)

    @_fuzz(UNAUTHENTICATED)
    @given(
        case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
        | operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)
        if _has_inputs(operation)
        else operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
    )
    def fuzz(case: AnyCase) -> None:
        response = case.call(base_url=served.base, session=session, headers=headers, timeout=30)
        assert response.status_code == expected, f"{way}: {_label(operation)} -> {response.status_code}"
        assert response.json()["reason"] in {"no_token", "bad_token", "bad_host", "cross_origin"}
        tally[way] += 1
        tally["cases"] += 1

    fuzz()


@pytest.mark.integration
@pytest.mark.slow
def test_every_operation_without_the_token_is_refused_401_or_403(served: Served, schema: OpenApiSchema) -> None:
    """Every operation, with generated data and no token, a wrong token or another scheme, is answered
    401; with the right token but another Host or a cross-site Origin or Sec-Fetch-Site, 403: the guard
    refuses before any handler runs, never with a 5xx."""
    ops = operations(schema)
    tally: Counter[str] = Counter()
    for operation in ops:
        for way in WAYS:
            fuzz_unauthenticated(served, operation, way, tally)
    assert served.get(STATUS).json()["state"] == "running"
    assert all(tally[way] >= len(ops) for way in WAYS), tally
    record(
        "fuzz.control_api.unauthenticated",
        operations=len(ops),
        cases=tally["cases"],
        **{way: tally[way] for way in WAYS},
        server_errors=0,
        crashes=0,
    )


@pytest.mark.integration
@pytest.mark.slow
def test_the_daemon_survived_the_fuzzing_and_logged_no_handler_error(served: Served) -> None:
    """After the fuzzing the daemon still runs, answers its status with the token, and its log holds no
    ``control_api_error`` (what a handler's unexpected exception, a 500, logs) and no traceback."""
    assert served.daemon.proc is not None
    assert served.daemon.proc.poll() is None, "the daemon exited"
    status = served.get(STATUS)
    assert status.status_code == 200
    assert status.json()["state"] == "running"
    log = served.daemon.log_path.read_text(errors="replace")
    assert "control_api_error" not in log
    assert "Traceback" not in log
    record("fuzz.control_api.alive", daemon_running=1, handler_errors_logged=0, crashes=0)


@dataclass
class _Target:
    """A ControlTarget over an empty store."""

    manager: ConversationManager
    metrics: Metrics = field(default_factory=Metrics)

    def status(self) -> dict[str, Any]:
        """A fixed status."""
        return {"state": "running"}


@pytest.mark.parametrize(("limit", "status"), [("²", 400), ("5³", 400), ("½", 400), ("٣", 200), ("12", 200)])
async def test_a_limit_of_digits_int_cannot_read_is_a_400_not_a_500(limit: str, status: int) -> None:
    """A ``limit`` of characters that are digits to ``str.isdigit`` but not to ``int`` (superscripts, found
    by this fuzzing as ``?limit=²`` -> 500) is refused with a 400 naming the parameter; decimal digits of
    any script still count."""
    app = create_app(_Target(ConversationManager(MemoryStore(), [])))
    async with TestClient(TestServer(app)) as client:
        response = await client.get(CONVERSATIONS, params={"limit": limit})
        assert response.status == status, await response.text()
        if status == 400:
            assert "limit" in (await response.json())["error"]
