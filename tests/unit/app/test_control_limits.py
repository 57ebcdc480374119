"""What anyone on the host can throw at the control API costs the daemon little: connections on the TCP port
are capped and closed when idle, refusals are logged a few times per reason a while, and numbers too long
for Python to read are a 400."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from tenex_daemon import ConversationManager, NostrEvent
from tenex_daemon.app.control import server as control_server
from tenex_daemon.app.control.guard import LOGGED_CHARS, LOGGED_PER_INTERVAL, RefusalLog
from tenex_daemon.app.control_api import ControlServer, create_app
from tests.conftest import Cast
from tests.unit.app.test_control_security import FakeTarget, base, call

HUGE_NUMBER = "1" * 5000
"""More digits than Python 3.11 reads into an int (4,300 by default)."""


@pytest.fixture
async def root(cast: Cast, manager: ConversationManager) -> NostrEvent:
    """A conversation the requests name."""
    event = cast.user_says("Plans", kind=11, tags=[["title", "Plans"], ["p", cast.alice.pubkey]])
    await manager.create_conversation(event)
    return event


@pytest.fixture
def held() -> Iterator[list[socket.socket]]:
    """Client sockets a test opens, closed after it."""
    sockets: list[socket.socket] = []
    yield sockets
    for sock in sockets:
        sock.close()


def closed_by_server(sock: socket.socket, within_s: float = 0.0) -> bool:
    """Whether the server closed ``sock`` (end of stream, or a reset) within ``within_s`` seconds (0: by
    now)."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except ConnectionResetError:
        return True


async def socket_status(server: ControlServer) -> int:
    """The status of ``GET /api/v1/status`` asked on the server's Unix socket, as the owner's CLI does."""
    connector = aiohttp.UnixConnector(path=str(server.socket_path))
    async with aiohttp.ClientSession(connector=connector) as session, session.get(
        "http://tenexd/api/v1/status", timeout=aiohttp.ClientTimeout(total=5)
    ) as response:
        return response.status


def refused_connections(server: ControlServer) -> float:
    """The metric's count of the TCP connections closed for being past the cap."""
    line = 'tenexd_control_requests_refused_total{reason="too_many_connections"} '
    found = [text for text in server.target.metrics.render().decode().splitlines() if text.startswith(line)]
    return float(found[0][len(line):]) if found else 0.0


def tcp_status(server: ControlServer) -> int | None:
    """The status of ``GET /api/v1/status`` with the token on one new TCP connection; None when the server
    closed it unanswered (as it does past the cap). Blocking: run it off the server's event loop."""
    assert server.tcp_address is not None
    host, port = server.tcp_address
    request = (
        f"GET /api/v1/status HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {server.token}\r\n"
        "Connection: close\r\n\r\n"
    )
    with socket.create_connection(server.tcp_address, timeout=5) as sock:
        try:
            sock.sendall(request.encode())
            head = sock.recv(64)
        except (ConnectionResetError, BrokenPipeError):
            return None
    return int(head.split()[1]) if head else None


async def test_connections_past_the_cap_are_closed_and_the_owner_is_still_answered(
    manager: ConversationManager, tmp_path: Path, held: list[socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With more connections held open on the TCP port than its cap, those past the cap are closed at once
    and counted, and the owner is still answered on the socket and, once some close, on TCP."""
    monkeypatch.setattr(control_server, "IDLE_CONNECTION_S", 60)  # none is closed for being idle here
    cap, extra = control_server.TCP_CONNECTIONS_MAX, 8
    closed: set[int] = set()

    def count_closed() -> int:
        closed.update(i for i, sock in enumerate(held) if i not in closed and closed_by_server(sock))
        return len(closed)

    async with ControlServer(FakeTarget(manager), tmp_path / "control.sock", tcp_port=0) as server:
        assert server.tcp_address is not None
        for index in range(cap + extra):
            sock = socket.create_connection(server.tcp_address)
            if index % 2:  # half send a request they never finish
                sock.sendall(b"GET /api/v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            held.append(sock)
        deadline = time.monotonic() + 5
        while count_closed() < extra and time.monotonic() < deadline:  # noqa: ASYNC110 - polling sockets
            await asyncio.sleep(0.02)

        assert count_closed() == extra
        assert refused_connections(server) == extra
        assert await socket_status(server) == 200
        assert count_closed() == extra  # and no more, after the server went on
        for sock in held[:extra]:
            sock.close()
        refused_again = 0  # tries on TCP before the server saw those close (each refused, and counted)
        deadline = time.monotonic() + 5
        while (status := await asyncio.to_thread(tcp_status, server)) is None and time.monotonic() < deadline:
            refused_again += 1
            await asyncio.sleep(0.05)
        assert status == 200
        assert refused_connections(server) == extra + refused_again


async def test_a_connection_that_sends_no_whole_request_is_closed(
    manager: ConversationManager, held: list[socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection that stays idle, or sends a request's headers a line at a time and never ends them, is
    closed by the server once its idle time is up (aiohttp's default kept it an hour)."""
    monkeypatch.setattr(control_server, "IDLE_CONNECTION_S", 0.5)
    async with ControlServer(FakeTarget(manager), None, tcp_port=0) as server:
        assert server.tcp_address is not None
        idle = socket.create_connection(server.tcp_address)
        slow = socket.create_connection(server.tcp_address)
        held.extend((idle, slow))
        slow.sendall(b"GET /api/v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for _ in range(3):
            await asyncio.sleep(0.2)
            slow.sendall(b"X-More: 1\r\n")

        assert await asyncio.to_thread(closed_by_server, idle, 5)
        assert await asyncio.to_thread(closed_by_server, slow, 5)


async def test_refusals_are_logged_a_few_times_per_reason_a_while_and_all_counted(
    manager: ConversationManager
) -> None:
    """Refused requests with a long path are all counted, but only the first few of a reason in the interval
    are logged, the path cut as Host and Origin are."""
    many = LOGGED_PER_INTERVAL + 7
    async with ControlServer(FakeTarget(manager), None, tcp_port=0) as server:
        url = f"{base(server)}/{'a' * 8000}"
        with capture_logs() as logs:
            for _ in range(many):
                assert (await call("GET", url))[0] == 401
            assert (await call("GET", url, {"Origin": "http://evil.example"}))[0] == 403
        metrics = server.target.metrics.render().decode()

    refused = [entry for entry in logs if entry["event"] == "control_request_refused"]
    assert [entry["reason"] for entry in refused] == ["no_token"] * LOGGED_PER_INTERVAL + ["cross_origin"]
    assert all(len(entry["path"]) <= LOGGED_CHARS for entry in refused)
    assert f'tenexd_control_requests_refused_total{{reason="no_token"}} {many}.0' in metrics


def test_a_refusal_log_says_how_many_it_left_out_once_the_interval_is_past() -> None:
    """Past its interval, a reason's next line carries the count of its refusals not logged before it; other
    reasons are logged apart."""
    now = [100.0]
    log_refusal = RefusalLog("refused", interval_s=10, per_interval=2, clock=lambda: now[0])
    with capture_logs() as logs:
        for index in range(5):
            log_refusal("no_token", path=f"/{index}")
        log_refusal("bad_host", path="/h")
        now[0] += 10
        log_refusal("no_token", path="/later")
        log_refusal("no_token", path="/later too")

    assert [(entry["reason"], entry["path"], entry.get("not_logged")) for entry in logs] == [
        ("no_token", "/0", None), ("no_token", "/1", None), ("bad_host", "/h", None),
        ("no_token", "/later", 3), ("no_token", "/later too", None),
    ]


@pytest.mark.parametrize("path", ["{id}/reset", "{id}/end", "{id}/stop", "rebuild"])
async def test_a_body_with_a_number_too_long_to_read_is_a_400(
    manager: ConversationManager, root: NostrEvent, path: str
) -> None:
    """A JSON body holding an integer of more digits than Python reads is a 400 saying so, not a logged
    500."""
    async with TestClient(TestServer(create_app(FakeTarget(manager)))) as client:
        with capture_logs() as logs:
            response = await client.post(
                f"/api/v1/conversations/{path.format(id=root.id)}", data=f'{{"all": true, "x": {HUGE_NUMBER}}}',
                headers={"Content-Type": "application/json"},
            )
            body: dict[str, Any] = await response.json()

    assert response.status == 400, body
    assert "digits" in body["error"]
    assert not [entry for entry in logs if entry["event"] == "control_api_error"]


async def test_a_limit_too_long_to_read_is_a_400(manager: ConversationManager) -> None:
    """A ``limit`` of more digits than Python reads is a 400 naming the parameter, not a logged 500; leading
    zeros are still read."""
    async with TestClient(TestServer(create_app(FakeTarget(manager)))) as client:
        with capture_logs() as logs:
            response = await client.get("/api/v1/conversations", params={"limit": HUGE_NUMBER})
            body: dict[str, Any] = await response.json()
            padded = await client.get("/api/v1/conversations", params={"limit": "0" * 5000 + "5"})

    assert response.status == 400, body
    assert "limit" in body["error"]
    assert padded.status == 200, await padded.text()
    assert not [entry for entry in logs if entry["event"] == "control_api_error"]
