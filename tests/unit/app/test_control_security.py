"""The control API on loopback TCP asks for its token, and refuses other Host headers and cross-origin
requests (DNS rebinding, cross-site POST); the Unix socket is unchanged; bodies too deep are a 400."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from typer.testing import CliRunner

from tenex_daemon import ConversationManager, NostrEvent
from tenex_daemon.app.control_api import ControlServer, create_app
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.app.settings import ControlSettings, load_settings
from tenex_daemon.cli import listeners
from tenex_daemon.cli.access import open_access
from tenex_daemon.cli.main import app as cli_app
from tenex_daemon.cli.references import AccessError
from tenex_daemon.testing import KeyPair
from tests.conftest import Cast


@dataclass
class FakeTarget:
    """A ControlTarget: the manager, metrics and a fixed status."""

    manager: ConversationManager
    metrics: Metrics = field(default_factory=Metrics)

    def status(self) -> dict[str, Any]:
        """Return a fixed status."""
        return {"state": "running"}


@pytest.fixture
async def root(cast: Cast, manager: ConversationManager) -> NostrEvent:
    """A conversation the attacker would like to read or archive."""
    event = cast.user_says("Secret plans", kind=11, tags=[["title", "Secret"], ["p", cast.alice.pubkey]])
    await manager.create_conversation(event)
    return event


@pytest.fixture
async def tcp(manager: ConversationManager, tmp_path: Path) -> AsyncIterator[ControlServer]:
    """A control server on a free loopback TCP port, its token in ``tmp_path/run/control.token``."""
    server = ControlServer(FakeTarget(manager), None, tcp_port=0, token_path=tmp_path / "run" / "control.token")
    async with server:
        yield server


def base(server: ControlServer) -> str:
    """The server's TCP base URL."""
    assert server.tcp_address is not None
    return f"http://127.0.0.1:{server.tcp_address[1]}"


def bearer(server: ControlServer) -> dict[str, str]:
    """The Authorization header carrying the server's token."""
    assert server.token is not None
    return {"Authorization": f"Bearer {server.token}"}


async def call(method: str, url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """Send one request; return (status, decoded JSON body)."""
    async with aiohttp.ClientSession() as session, session.request(method, url, headers=headers) as response:
        return response.status, await response.json(content_type=None)


async def test_dns_rebinding_host_is_refused(tcp: ControlServer, root: NostrEvent) -> None:
    """A request whose Host is another name (a rebound DNS name) gets 403, even with the token: no
    conversation is read through it."""
    port = tcp.tcp_address[1] if tcp.tcp_address else 0
    status, body = await call(
        "GET", f"{base(tcp)}/api/v1/conversations", {"Host": f"evil.example:{port}", **bearer(tcp)}
    )

    assert status == 403
    assert "Host" in body["error"]
    assert "conversations" not in body


async def test_cross_site_post_is_refused(tcp: ControlServer, root: NostrEvent, manager: ConversationManager) -> None:
    """A cross-site POST (Origin of another site, no token) gets 403 and archives nothing."""
    status, body = await call(
        "POST", f"{base(tcp)}/api/v1/conversations/{root.id}/archive", {"Origin": "http://evil.example"}
    )

    assert status == 403
    assert "Origin" in body["error"]
    conversation = await manager.get_conversation(root.id)
    assert conversation is not None
    assert not conversation.archived


async def test_cross_origin_is_refused_even_with_the_token(tcp: ControlServer, root: NostrEvent) -> None:
    """An Origin other than the server's own (here ``null``, a sandboxed page) gets 403 with the token too."""
    status, _ = await call("GET", f"{base(tcp)}/api/v1/conversations", {"Origin": "null", **bearer(tcp)})

    assert status == 403


async def test_tcp_needs_the_token(tcp: ControlServer, root: NostrEvent) -> None:
    """Without the token, or with a wrong one, TCP answers 401 (every endpoint, /metrics too); with it, 200."""
    url = f"{base(tcp)}/api/v1/conversations"
    assert (await call("GET", url))[0] == 401
    assert (await call("GET", url, {"Authorization": "Bearer wrong"}))[0] == 401
    assert (await call("GET", f"{base(tcp)}/api/v1/status"))[0] == 401
    async with aiohttp.ClientSession() as session, session.get(f"{base(tcp)}/metrics") as response:
        assert response.status == 401
        assert response.headers["WWW-Authenticate"].startswith("Bearer")

    status, body = await call("GET", url, bearer(tcp))

    assert status == 200
    assert body["count"] == 1


async def test_same_origin_and_localhost_are_accepted(tcp: ControlServer, root: NostrEvent) -> None:
    """Host ``localhost:PORT`` and an Origin of the server itself are served (with the token)."""
    port = tcp.tcp_address[1] if tcp.tcp_address else 0
    headers = {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}", **bearer(tcp)}

    status, body = await call("GET", f"{base(tcp)}/api/v1/conversations", headers)

    assert status == 200
    assert body["count"] == 1


async def test_refusals_are_counted_by_reason(tcp: ControlServer, root: NostrEvent) -> None:
    """Each refusal is counted in the metrics under its reason."""
    await call("GET", f"{base(tcp)}/api/v1/status")
    await call("GET", f"{base(tcp)}/api/v1/status", {"Origin": "http://evil.example"})
    text = tcp.target.metrics.render().decode()

    assert 'tenexd_control_requests_refused_total{reason="no_token"} 1.0' in text
    assert 'tenexd_control_requests_refused_total{reason="cross_origin"} 1.0' in text


async def test_token_file_is_created_0600_and_kept(manager: ConversationManager, tmp_path: Path) -> None:
    """The token file is created with mode 0600 when missing and reused by the next start."""
    path = tmp_path / "run" / "control.token"
    async with ControlServer(FakeTarget(manager), None, tcp_port=0, token_path=path) as first:
        token = first.token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert token is not None
    assert len(token) >= 32
    assert path.read_text().strip() == token
    async with ControlServer(FakeTarget(manager), None, tcp_port=0, token_path=path) as second:
        assert second.token == token


async def test_token_file_readable_by_others_is_refused(manager: ConversationManager, tmp_path: Path) -> None:
    """A token file other users can read is refused at start, naming the file."""
    path = tmp_path / "control.token"
    path.write_text("x" * 43)
    os.chmod(path, 0o644)

    with pytest.raises(ValueError, match=r"control\.token"):
        await ControlServer(FakeTarget(manager), None, tcp_port=0, token_path=path).start()


async def test_unix_socket_needs_no_token(manager: ConversationManager, tmp_path: Path, root: NostrEvent) -> None:
    """The Unix socket (protected by its file mode) answers without a token, with the socket's Host."""
    path = tmp_path / "control.sock"
    async with ControlServer(FakeTarget(manager), path, tcp_port=0), aiohttp.ClientSession(
        connector=aiohttp.UnixConnector(path=str(path))
    ) as session, session.get("http://tenexd/api/v1/conversations") as response:
        assert response.status == 200
        assert (await response.json())["count"] == 1


async def test_deeply_nested_body_is_a_400(manager: ConversationManager, root: NostrEvent) -> None:
    """A JSON body nested deeper than the parser's recursion limit is a 400, not a 500."""
    async with TestClient(TestServer(create_app(FakeTarget(manager)))) as client:
        response = await client.post(
            f"/api/v1/conversations/{root.id}/reset",
            data="[" * 30_000 + "]" * 30_000,
            headers={"Content-Type": "application/json"},
        )
        assert response.status == 400, await response.text()
        assert "JSON" in (await response.json())["error"]


async def test_a_token_that_is_not_utf8_is_a_wrong_token(tcp: ControlServer, root: NostrEvent) -> None:
    """An Authorization header whose bytes are not UTF-8 gets 401 with a JSON body, counted as bad_token,
    like any other wrong token (it was a 500 in plain text, neither logged as a refusal nor counted)."""
    assert tcp.tcp_address is not None
    port = tcp.tcp_address[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"GET /api/v1/conversations HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % port
        + b"Authorization: Bearer \xff\xfeabc\r\nConnection: close\r\n\r\n"
    )
    answer = await reader.read()
    writer.close()

    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401")
    assert "error" in json.loads(body)
    assert 'tenexd_control_requests_refused_total{reason="bad_token"} 1.0' in tcp.target.metrics.render().decode()


async def test_a_body_in_a_charset_python_lacks_is_a_400(manager: ConversationManager, root: NostrEvent) -> None:
    """A JSON body declared in a charset Python does not know is a 400 naming JSON, not a 500."""
    async with TestClient(TestServer(create_app(FakeTarget(manager)))) as client:
        response = await client.post(
            f"/api/v1/conversations/{root.id}/reset",
            data=b"{}",
            headers={"Content-Type": "application/json; charset=foo"},
        )
        assert response.status == 400, await response.text()
        assert "JSON" in (await response.json())["error"]


async def test_cli_reaches_the_daemon_over_tcp_with_the_token(
    manager: ConversationManager, root: NostrEvent, tmp_path: Path
) -> None:
    """With no answer on the socket and control.tcp_port set, the CLI talks TCP, sending the home's token."""
    home = tmp_path / "home"
    result = CliRunner().invoke(cli_app, ["--home", str(home), "init", "--owner", KeyPair.from_seed(5).npub])
    assert result.exit_code == 0, result.stdout
    settings = load_settings(home)
    async with ControlServer(FakeTarget(manager), None, tcp_port=0, token_path=settings.control_token_path) as server:
        assert server.tcp_address is not None
        control = ControlSettings(socket=str(tmp_path / "nobody.sock"), tcp_port=server.tcp_address[1])
        settings = settings.model_copy(update={"control": control})
        async with open_access(settings) as access:
            rows = await access.search({})

    assert access.via == "control API"
    assert [row["id"] for row in rows] == [root.id]


async def test_cli_never_sends_the_token_to_a_port_another_user_listens_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the daemon down and another user listening on control.tcp_port (as the kernel's table of
    sockets says), the CLI fails naming that user and the listener receives no token; nobody listening
    at all is no daemon, and the CLI goes to the store."""
    home = tmp_path / "home"
    result = CliRunner().invoke(cli_app, ["--home", str(home), "init", "--owner", KeyPair.from_seed(5).npub])
    assert result.exit_code == 0, result.stdout
    settings = load_settings(home)
    settings.control_token_path.parent.mkdir(parents=True, exist_ok=True)
    settings.control_token_path.write_text("t" * 43)
    os.chmod(settings.control_token_path, 0o600)
    received = bytearray()

    async def squatter(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.extend(await reader.read(65536))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(squatter, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    stranger = settings.control_token_path.stat().st_uid + 1
    table = tmp_path / "tcp"
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    table.write_text(header + f"   0: 0100007F:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000 "
                     f"{stranger:5d}        0 1 1 0 100 0 0 10 0\n")
    monkeypatch.setattr(listeners, "PROC_NET_TCP", (table,))
    control = ControlSettings(socket=str(tmp_path / "nobody.sock"), tcp_port=port)
    settings = settings.model_copy(update={"control": control})
    async with server:
        with pytest.raises(AccessError, match=f"uid {stranger}, not by the daemon's user"):
            async with open_access(settings):
                pass
        table.write_text(header)  # nobody listens on the port
        async with open_access(settings) as access:
            via = access.via

    assert received == b""
    assert via == "store"


def test_the_listeners_counted_are_those_a_connection_to_127_0_0_1_reaches(tmp_path: Path) -> None:
    """Of the sockets the kernel's tables list on a port, those listening on 127.0.0.1, 0.0.0.0, :: or
    ::ffff:127.0.0.1 count; one on another loopback address, on ::1 only, another port, or not listening
    does not (another user's listener there would not get the CLI's connection, so it refuses nothing)."""
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"

    def line(address: str, port: int, state: str, uid: int) -> str:
        return f"   0: {address}:{port:04X} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000 {uid:5d} 0 1\n"

    v4, v6 = tmp_path / "tcp", tmp_path / "tcp6"
    v4.write_text(header + line("0100007F", 7000, "0A", 5) + line("0200007F", 7000, "0A", 6)
                  + line("00000000", 7000, "0A", 8) + line("0100007F", 7000, "01", 9)
                  + line("0100007F", 7001, "0A", 10))
    v6.write_text(header + line("00000000000000000000000001000000", 7000, "0A", 7)
                  + line("0000000000000000FFFF00000100007F", 7000, "0A", 11))

    assert listeners.listener_uids(7000, (v4, v6)) == {5, 8, 11}
    assert listeners.listener_uids(7002, (v4, v6)) == set()
    assert listeners.listener_uids(7000, (tmp_path / "none",)) is None


async def test_cli_names_the_token_file_when_the_daemon_refuses_it(
    manager: ConversationManager, tmp_path: Path
) -> None:
    """A token file that is not the daemon's own makes the CLI fail with a message naming the file."""
    home = tmp_path / "home"
    result = CliRunner().invoke(cli_app, ["--home", str(home), "init", "--owner", KeyPair.from_seed(5).npub])
    assert result.exit_code == 0, result.stdout
    settings = load_settings(home)
    async with ControlServer(FakeTarget(manager), None, tcp_port=0, token_path=tmp_path / "daemon.token") as server:
        assert server.tcp_address is not None
        settings.control_token_path.parent.mkdir(parents=True, exist_ok=True)
        settings.control_token_path.write_text("y" * 43)
        os.chmod(settings.control_token_path, 0o600)
        control = ControlSettings(socket=str(tmp_path / "nobody.sock"), tcp_port=server.tcp_address[1])
        settings = settings.model_copy(update={"control": control})
        with pytest.raises(AccessError, match=r"control\.token"):
            async with open_access(settings):
                pass
