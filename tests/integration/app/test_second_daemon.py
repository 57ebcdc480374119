"""A second daemon started on a home a running daemon holds is refused before it touches anything of
that daemon's: the store's lock ("in use by process N") is taken before its embedded relay starts,
and it never writes the home's status file."""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tenex_daemon.adapters.storage.filesystem import StoreLockedError
from tenex_daemon.adapters.storage.postgres import PostgresStore
from tenex_daemon.app.daemon import Daemon
from tenex_daemon.app.home import init_home
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.status import Health, read_status
from tests.contract.postgres_server import PostgresServer, find_bin_dir, shared_server
from tests.e2e.harness import TENEXD, DaemonProcess, Home, tenexd_environment
from tests.integration.nostr.harness import free_port

pytestmark = [pytest.mark.integration]

STATUS_INTERVAL_S = "60"
"""The first daemon writes its status file when ready, then not again during a test: any change to
the file in the meantime is the second daemon's."""


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[tuple[DaemonProcess, int]]:
    """``tenexd run --embedded-relay`` on a fresh home (a subprocess: its own pid), and its relay's port."""
    home = Home(tmp_path / "h", init_home(tmp_path / "h"))
    port = free_port()
    env = {"TENEX_RELAYS__EMBEDDED_PORT": str(port), "TENEX_DAEMON__STALE_AFTER_S": "600"}
    first = DaemonProcess(home, "--embedded-relay", env=env)
    first.env["TENEX_DAEMON__STATUS_INTERVAL_S"] = STATUS_INTERVAL_S
    try:
        await first.start(within=60)
        await status_settled(home.path / "run" / "status.json")
        yield first, port
    finally:
        await first.stop()


async def status_settled(path: Path, quiet_s: float = 1.0, within: float = 20.0) -> None:
    """Wait until the status file has not changed for ``quiet_s``: a daemon that reports running writes it
    once or twice more as it finishes starting (its relay connected, its first status round), then not for
    ``STATUS_INTERVAL_S``."""
    deadline = asyncio.get_running_loop().time() + within
    last, since = await asyncio.to_thread(path.read_bytes), asyncio.get_running_loop().time()
    while asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
        now, current = asyncio.get_running_loop().time(), await asyncio.to_thread(path.read_bytes)
        if current != last:
            last, since = current, now
        elif now - since >= quiet_s:
            return
    raise TimeoutError(f"{path} kept changing for {within} s")


def snapshot(home: Path) -> dict[str, bytes | bool]:
    """The running daemon's files a refused start must leave alone: its status file and relay log (their
    bytes), its control socket (there)."""
    files: dict[str, bytes | bool] = {name: (home / name).read_bytes() for name in ("run/status.json", "relay.log")}
    files["run/control.sock"] = (home / "run" / "control.sock").is_socket()
    return files


async def assert_first_serves(first: DaemonProcess, port: int) -> None:
    """The first daemon still runs, its embedded relay accepts connections, its status says so."""
    assert first.proc is not None
    assert first.proc.poll() is None
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.close()
    report = read_status(first.home.path / "run" / "status.json", 600)
    assert report.state is Health.RUNNING
    assert report.data is not None
    assert (report.data["pid"], report.data["state"]) == (first.proc.pid, "running")


@pytest.mark.parametrize("same_port", [True, False], ids=["same-embedded-port", "another-embedded-port"])
async def test_a_second_daemon_on_a_held_home_is_refused_and_leaves_the_first_alone(
    running: tuple[DaemonProcess, int], same_port: bool
) -> None:
    """A second Daemon on a home a running daemon holds fails with the store's "in use by process N", whether its
    embedded relay's port is the first's or another, and the first keeps running, its status file unchanged."""
    first, port = running
    assert first.proc is not None
    home = first.home.path
    before = snapshot(home)
    env = {"TENEX_RELAYS__EMBEDDED_PORT": str(port if same_port else free_port())}
    settings = load_settings(home, env)
    settings = settings.model_copy(update={"relays": settings.relays.model_copy(update={"embedded": True})})
    second = Daemon(settings)
    with pytest.raises(StoreLockedError, match=f"in use by process {first.proc.pid};"):
        await asyncio.wait_for(second.run(), 60)
    assert second.embedded_relay is None
    assert snapshot(home) == before
    await assert_first_serves(first, port)


async def test_tenexd_run_on_a_held_home_says_so_without_a_traceback(running: tuple[DaemonProcess, int]) -> None:
    """`tenexd run --embedded-relay` on a home a daemon holds exits 1 saying the home is in use by that daemon's
    process, with no traceback, and leaves the first daemon and its status file as they were."""
    first, port = running
    assert first.proc is not None
    home = first.home.path
    before = snapshot(home)
    env = {**tenexd_environment(), "TENEX_RELAYS__EMBEDDED_PORT": str(port)}
    done = await asyncio.to_thread(
        subprocess.run, [str(TENEXD), "--home", str(home), "run", "--embedded-relay"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )
    assert done.returncode == 1, done.stderr
    assert f"in use by process {first.proc.pid};" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert done.stderr.count("\n") <= 3, done.stderr
    assert snapshot(home) == before
    await assert_first_serves(first, port)


async def test_tenexd_run_whose_embedded_port_another_program_holds_says_so_without_a_traceback(
    tmp_path: Path,
) -> None:
    """`tenexd run --embedded-relay` whose relay port another program listens on exits 1 with the relay's error
    in a few lines, no Python traceback (the relay's error was no TenexError: typer printed ~56 lines)."""
    home = tmp_path / "h"
    init_home(home)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    try:
        env = {**tenexd_environment(), "TENEX_RELAYS__EMBEDDED_PORT": str(squatter.getsockname()[1])}
        done = await asyncio.to_thread(
            subprocess.run, [str(TENEXD), "--home", str(home), "run", "--embedded-relay"],
            capture_output=True, text=True, env=env, timeout=90, check=False,
        )
    finally:
        squatter.close()
    assert done.returncode == 1, done.stderr
    assert "embedded relay" in done.stderr
    assert "Traceback (most recent call last)" not in done.stderr + done.stdout


@pytest.fixture
def postgres() -> PostgresServer:
    """The session's real PostgreSQL server (shared with the contract suite)."""
    if find_bin_dir() is None:
        pytest.skip("PostgreSQL is not installed; scripts/setup.d/20-postgres.sh installs it")
    return shared_server()


def postgres_home(tmp_path: Path, dsn: str) -> tuple[Path, str]:
    """A fresh home on PostgreSQL at ``dsn`` named ``d1`` (daemon.instance_id); its project's pubkey."""
    home = tmp_path / "h"
    made = init_home(home)
    config = home / "config.toml"
    text = config.read_text(encoding="utf-8").replace('kind = "filesystem"', f'kind = "postgres"\ndsn = "{dsn}"')
    config.write_text(text.replace("[daemon]\n", '[daemon]\ninstance_id = "d1"\n', 1), encoding="utf-8")
    return home, made.project.pubkey


async def tenexd_run(home: Path) -> subprocess.CompletedProcess[str]:
    """`tenexd run` on ``home`` toward a relay nobody serves (what is tested fails before any relay)."""
    return await asyncio.to_thread(
        subprocess.run, [str(TENEXD), "--home", str(home), "run", "--relay", f"ws://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, env=tenexd_environment(), timeout=90, check=False,
    )


async def test_a_daemon_whose_name_another_holds_on_the_database_says_so(
    tmp_path: Path, postgres: PostgresServer
) -> None:
    """`tenexd run` named like a daemon already on the database (the same daemon.instance_id) exits 1 saying
    so and what to change, in a line, no traceback (it printed "error: " and nothing else), and writes no
    status file (it wrote "stopped" where the daemon holding the name may write its own)."""
    dsn = await postgres.create_database()
    home, project = postgres_home(tmp_path, dsn)
    holder = PostgresStore(dsn)
    await holder.open()
    try:
        async with holder.alive(f"instance:{project}.d1"):
            done = await tenexd_run(home)
    finally:
        await holder.close()
    assert done.returncode == 1, done.stderr
    assert "another daemon on this database is named 'd1' (daemon.instance_id)" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not (home / "run" / "status.json").exists()  # the name's holder may share this home: left alone


async def test_a_database_that_cannot_be_opened_is_named_with_its_password_hidden(
    tmp_path: Path, postgres: PostgresServer
) -> None:
    """`tenexd run` on a database that does not exist exits 1 naming the database (its password shown as ***)
    and the server's reason, in a line, no traceback (it printed asyncpg's 78-line traceback)."""
    dsn = postgres.dsn("nosuchdb").replace("postgres@", "postgres:hunter2@")
    home, _ = postgres_home(tmp_path, dsn)

    done = await tenexd_run(home)

    assert done.returncode == 1, done.stderr
    shown = dsn.replace("hunter2", "***")
    assert f"cannot open the PostgreSQL store at {shown}: database \"nosuchdb\" does not exist" in done.stderr
    assert "hunter2" not in done.stderr + done.stdout
    assert "Traceback" not in done.stderr + done.stdout
