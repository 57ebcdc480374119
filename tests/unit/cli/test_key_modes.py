"""Key files and the keys/ folder too open are refused, and the command line says so with exit 2 (README:
"2 bad input or configuration")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenex_daemon.adapters.nostr.signer import KeyFileError, Signer, write_key_file
from tenex_daemon.cli.main import app
from tests.unit.cli.conftest import tenexd


def test_run_refuses_a_key_file_readable_by_others_with_exit_2(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``tenexd run`` with a 0644 agent key exits 2 (a configuration problem), naming the file and its mode."""
    key = home / "keys" / "project.key"
    key.chmod(0o644)

    code, _ = tenexd(home, "run", "--relay", "ws://127.0.0.1:1")

    assert code == 2


def test_run_refuses_a_keys_folder_others_may_enter_with_exit_2(home: Path) -> None:
    """``tenexd run`` with a 0755 keys/ folder exits 2: the folder must be 0700 like the files are 0600."""
    (home / "keys").chmod(0o755)

    code, _ = tenexd(home, "run", "--relay", "ws://127.0.0.1:1")

    assert code == 2


def test_run_refuses_a_control_token_readable_by_others_with_exit_2(home: Path) -> None:
    """``tenexd run`` with control.tcp_port set and a 0644 run/control.token exits 2 (configuration), as a
    key file too open does; it ended in a traceback and exit 1."""
    with (home / "config.toml").open("a") as config:
        config.write("\n[control]\ntcp_port = 1\n")
    token = home / "run" / "control.token"
    token.parent.mkdir(mode=0o700, exist_ok=True)
    token.write_text("t" * 43)
    token.chmod(0o644)

    code, _ = tenexd(home, "run", "--relay", "ws://127.0.0.1:1")

    assert code == 2


def test_run_refuses_a_control_socket_path_too_long_with_exit_2(home: Path, tmp_path: Path) -> None:
    """``tenexd run`` whose control socket path is longer than a Unix socket's (107 bytes) exits 2 naming
    control.socket; it ended in a traceback and exit 1."""
    long_path = tmp_path / ("s" * 120) / "control.sock"
    with (home / "config.toml").open("a") as config:
        config.write(f"\n[control]\nsocket = \"{long_path}\"\n")

    code, _ = tenexd(home, "run", "--relay", "ws://127.0.0.1:1")

    assert code == 2


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o701, 0o770])
def test_a_key_in_a_folder_open_to_others_is_refused_naming_the_folder(tmp_path: Path, mode: int) -> None:
    """Signer.from_file refuses a 0600 key file whose folder group or others may access; the error names the
    folder and its mode, never the key."""
    folder = tmp_path / "keys"
    folder.mkdir(mode=0o700)
    signer = Signer.generate()
    path = folder / "agent.key"
    write_key_file(path, signer)
    folder.chmod(mode)

    with pytest.raises(KeyFileError) as caught:
        Signer.from_file(path)

    message = str(caught.value)
    assert str(folder) in message
    assert f"{mode:04o}" in message
    assert signer.secret_hex() not in message
    folder.chmod(0o700)
    assert Signer.from_file(path).pubkey == signer.pubkey


def test_run_with_json_logs_says_why_it_failed_in_a_json_line(home: Path) -> None:
    """``tenexd run --log-format json`` refusing a key file too open writes its reason as a JSON log line
    (``daemon_failed`` with the exit code), not plain ``error:`` text a log shipper cannot parse."""
    (home / "keys" / "project.key").chmod(0o644)

    args = ["--home", str(home), "run", "--relay", "ws://127.0.0.1:1", "--log-format", "json"]
    result = CliRunner().invoke(app, args, catch_exceptions=False)

    code = result.exit_code
    lines = [json.loads(line) for line in result.stderr.splitlines() if line.strip()]
    failed = [line for line in lines if line.get("event") == "daemon_failed"]
    assert code == 2
    assert [(line["level"], line["exit_code"]) for line in failed] == [("error", 2)]
    assert "project.key" in failed[0]["error"]
    assert not [line for line in result.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["run", "--log-format", "json"], "no relay configured"),
        (["run", "--relay", "ws://127.0.0.1:1", "--log-format", "json", "--log-level", "loud"], "log level"),
    ],
)
def test_run_with_json_logs_refused_before_starting_says_why_in_a_json_line(
    home: Path, args: list[str], why: str
) -> None:
    """A start refused before the daemon starts (no relay, a bad log level) with ``--log-format json``
    still says why in one JSON line (``daemon_failed``), exit 2."""
    config = home / "config.toml"
    config.write_text(config.read_text().replace('urls = ["ws://127.0.0.1:1"]', "urls = []"))
    result = CliRunner().invoke(app, ["--home", str(home), *args], catch_exceptions=False)

    lines = [json.loads(line) for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2
    assert [line["event"] for line in lines] == ["daemon_failed"]
    assert why in lines[0]["error"]


def test_run_with_json_logs_and_settings_refused_says_why_in_a_json_line(home: Path) -> None:
    """Settings refused (a config.toml that does not parse) with ``--log-format json``: one JSON line
    ``daemon_failed`` naming the file, exit 2."""
    (home / "config.toml").write_text("[daemon\n")

    args = ["--home", str(home), "run", "--log-format", "json"]
    result = CliRunner().invoke(app, args, catch_exceptions=False)

    lines = [json.loads(line) for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2
    assert [line["event"] for line in lines] == ["daemon_failed"]
    assert "config.toml" in lines[0]["error"]


def test_run_on_a_store_this_user_may_not_open_exits_2_saying_what_to_check(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversation store restored as another user's (its lock file this user may not open) makes ``tenexd
    run`` exit 2, which systemd's unit does not restart on, saying which file and what to check: it exited 1
    with a bare "[Errno 13] Permission denied" and systemd restarted it every 5 s for good."""
    from tenex_daemon.adapters.storage.filesystem import store as store_module

    lock = home / "conversations" / ".lock"

    def denied(root: Path) -> int:
        raise PermissionError(13, "Permission denied", str(lock))

    monkeypatch.setattr(store_module, "lock_home", denied)

    result = CliRunner().invoke(app, ["--home", str(home), "run", "--relay", "ws://127.0.0.1:1"])

    assert result.exit_code == 2
    assert f"{lock} cannot be read or written by this user (check its owner and mode)" in result.stderr


def test_run_whose_backend_needs_an_extra_not_installed_exits_2_naming_it(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent's backend whose optional package is not installed makes ``tenexd run`` exit 2 (a configuration
    problem: systemd's unit does not restart on it), naming the setting and the extra to install: it exited 1,
    and systemd restarted it every 5 s for good."""
    from tenex_daemon.adapters.llm.errors import MissingExtraError

    def not_installed(kind: str, **options: object) -> object:
        raise MissingExtraError("openai", "openai", "openai")

    monkeypatch.setattr("tenex_daemon.app.wiring.make_backend", not_installed)

    result = CliRunner().invoke(app, ["--home", str(home), "run", "--relay", "ws://127.0.0.1:1"])

    assert result.exit_code == 2
    assert "agents.orchestrator.backend: the openai backend needs the Python package 'openai'" in result.stderr
    assert "pip install 'tenexd[openai]'" in result.stderr


@pytest.mark.parametrize("refusal", ["StoreOfAnotherProjectError", "EmptyStoreError"])
def test_run_on_a_store_of_another_project_or_one_never_used_beside_the_homes_exits_2(
    home: Path, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    """The start checks' refusals of the store config.toml names (another project's; one never used while the
    home's own holds conversations, or a copy cut short) exit 2, which systemd's unit does not restart on:
    they exited 1, and systemd started the daemon again every 5 s for good."""
    from tenex_daemon.app import store_check
    from tenex_daemon.app.daemon import Daemon

    error = getattr(store_check, refusal)

    async def refused(self: Daemon) -> None:
        raise error("the store config.toml names serves another project")

    monkeypatch.setattr(Daemon, "run", refused)

    result = CliRunner().invoke(app, ["--home", str(home), "run", "--relay", "ws://127.0.0.1:1"])

    assert result.exit_code == 2
    assert "serves another project" in result.stderr


def test_run_with_a_storage_path_naming_a_file_exits_2_saying_so(home: Path, tmp_path: Path) -> None:
    """``storage.path`` naming a file: exit 2 with a line saying the store's folder is a file and to check
    ``storage.path`` (it exited 1 with a bare "[Errno 20] Not a directory")."""
    afile = tmp_path / "afile"
    afile.write_text("")
    config = home / "config.toml"
    config.write_text(config.read_text().replace("[storage]\n", f'[storage]\npath = "{afile}"\n', 1))

    result = CliRunner().invoke(app, ["--home", str(home), "run", "--relay", "ws://127.0.0.1:1"])

    assert result.exit_code == 2
    assert "that folder, or one above it, is a file (check storage.path)" in result.stderr
    assert "Errno" not in result.stderr


def test_run_refused_a_thread_by_the_system_says_which_limit_in_one_line(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon the system refuses a new thread (a process or thread limit) exits 1 with one line naming the
    limits to raise: it printed a Python traceback."""
    from tenex_daemon.app.daemon import Daemon

    async def refused(self: Daemon) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(Daemon, "run", refused)

    result = CliRunner().invoke(app, ["--home", str(home), "run", "--relay", "ws://127.0.0.1:1"])

    assert result.exit_code == 1
    assert "a process or thread limit (ulimit -u, systemd's TasksMax or LimitNPROC)" in result.stderr
    assert "Traceback" not in result.stderr
