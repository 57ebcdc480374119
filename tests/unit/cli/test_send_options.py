"""`tenexd send` refuses, with exit 2 and before any relay is opened, options it would otherwise drop or try in
vain: a --title on what is not a new kind-11 conversation, a --relay that is no ws:// or wss:// URL (as `init`,
`run` and `agents add --from` refuse it)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenex_daemon.app.home import init_home
from tenex_daemon.app.settings import load_settings
from tenex_daemon.cli.main import app
from tenex_daemon.cli.send import SendError, check_title
from tenex_daemon.testing import KeyPair
from tests.unit.cli.test_send_private_reply import Touched


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home made by init (its owner key generated), pointed at a relay nobody runs."""
    path = tmp_path / "home"
    init_home(path, relays=["ws://127.0.0.1:1"])
    return path


def tenexd(home: Path, *args: str) -> tuple[int, str]:
    """Run ``tenexd --home HOME ARGS``; return (exit code, stderr with its lines joined)."""
    result = CliRunner().invoke(app, ["--home", str(home), *args], catch_exceptions=False)
    return result.exit_code, " ".join(result.stderr.split())


@pytest.mark.parametrize(
    ("args", "leave_out"),
    [
        (["--kind", "1", "--to", "planner"], "--kind 1"),
        (["--reply-to", "ab" * 32], "--reply-to"),
        (["--reply-to", "ab" * 32, "--kind", "1"], "--reply-to"),
        (["--reply-to", "ab" * 32, "--kind", "1111"], "--reply-to"),
    ],
)
def test_a_title_on_what_is_not_a_new_kind_11_conversation_is_refused(
    home: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], leave_out: str
) -> None:
    """--title with --kind 1 or --reply-to (which carry no title) exits 2 saying --title is only for a new
    kind-11 conversation and what to leave out; nothing is signed and no relay is opened."""
    touched = Touched(monkeypatch)

    code, said = tenexd(home, "send", "x", "--title", "T", *args, "--timeout", "0.2")

    assert code == 2, said
    assert f"error: --title is only for a new kind-11 conversation: leave it out with {leave_out}" in said
    assert (touched.signed, touched.pools) == ([], [])


def test_a_title_is_taken_for_a_new_conversation() -> None:
    """`check_title` takes a title for a new message (kind 11, given or by default) and no title anywhere; a
    blank title is refused."""
    check_title("T", None, False)
    check_title("T", 11, False)
    check_title(None, 1, True)
    with pytest.raises(SendError):
        check_title("T", 1, False)
    with pytest.raises(SendError, match="--title is empty"):  # leave it out for the daemon's title
        check_title("  ", None, False)


@pytest.mark.parametrize(
    "command",
    [
        ["send", "x", "--timeout", "0.2"],
        ["agents", "add", "--from", "nevent1qqs0000"],
        ["run"],
    ],
)
def test_a_relay_url_that_is_not_a_websocket_one_is_refused_at_once(
    home: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    """`send --relay notaurl` (and `agents add --from`, `run`) exits 2 with init's message, `relay URL
    'notaurl' must start with ws:// or wss://`, before any relay is opened or anything signed."""
    touched = Touched(monkeypatch)

    code, said = tenexd(home, *command, "--relay", "wss://fine.example", "--relay", "notaurl")

    assert (code, said) == (2, "error: relay URL 'notaurl' must start with ws:// or wss://")
    assert (touched.signed, touched.pools) == ([], [])


def hinted_command(said: str, after: str) -> list[str]:
    """The arguments of the `tenexd ...` command an error names in backquotes right after ``after`` (without
    the leading `tenexd`)."""
    command = said.split(after + " `", 1)[1].split("`", 1)[0]
    words = shlex.split(command)
    assert words[0] == "tenexd", command
    return words[1:]


def test_send_from_a_home_without_keys_says_to_give_the_right_home_or_init(home: Path, tmp_path: Path) -> None:
    """`send` from a folder holding only a config.toml (the wrong --home, or the committed example home) exits
    2 saying the home has no keys and naming an `init --force` that works there (a plain `init` refuses an
    existing config.toml) and what --force rewrites; once it ran, `send` finds the keys."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.toml").write_text((home / "config.toml").read_text(encoding="utf-8"), encoding="utf-8")

    code, said = tenexd(bare, "send", "hi", "--to", "planner")

    assert code == 2
    assert said.startswith(f"error: this home ({bare}) has no keys")
    command = hinted_command(said, "make its keys with")
    assert command == ["--home", str(bare), "init", "--force", "--relay", "ws://127.0.0.1:1"]
    assert "--force rewrites config.toml as init writes it" in said
    assert "the key files there are kept" in said
    assert CliRunner().invoke(app, command, catch_exceptions=False).exit_code == 0
    assert "no keys" not in tenexd(bare, "send", "hi", "--to", "planner", "--timeout", "0.2")[1]


def test_send_from_a_home_whose_owner_was_given_by_public_key_names_an_init_that_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`send` from a home made with `init --owner NPUB` (no owner secret) exits 2 naming an `init --force` that
    works there (re-running init is refused without --force), keeping its relays and project and the owner's
    key allowed as whitelisted; once it ran, `send` goes on to the relays with the new owner key."""
    person = KeyPair.from_seed(78)
    path = tmp_path / "home"
    init_home(path, person.pubkey, relays=["ws://127.0.0.1:1"], project_name="picnic")

    code, said = tenexd(path, "send", "hi", "--to", "planner")

    assert code == 2
    assert said.startswith(f"error: this home has no owner secret ({path / 'keys' / 'owner.key'})")
    command = hinted_command(said, "have a new owner key made with")
    assert command == [
        "--home", str(path), "init", "--force", "--relay", "ws://127.0.0.1:1", "--project", "picnic",
        "--whitelist", person.npub,
    ]
    assert "re-run init without --owner" not in said
    assert CliRunner().invoke(app, command, catch_exceptions=False).exit_code == 0
    settings = load_settings(path)
    assert (settings.owner_key_path.exists(), settings.whitelist, settings.project.name) == (True, [person.pubkey], "picnic")
    touched = Touched(monkeypatch)
    assert "owner secret" not in tenexd(path, "send", "hi", "--to", "planner", "--timeout", "0.2")[1]
    assert touched.pools == [["ws://127.0.0.1:1"]]


def test_a_mistyped_agent_is_bad_input_said_before_any_relay_is_tried(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`send --to planer` exits 2 (bad input, as the README's exit codes say) naming the agents there are,
    before any relay is opened or anything signed (with no daemon up it said "no relay" first, then exit 1)."""
    touched = Touched(monkeypatch)

    code, said = tenexd(home, "send", "hi", "--to", "planer")

    assert (code, said) == (2, "error: unknown agent 'planer' (agents: orchestrator, planner, executor)")
    assert (touched.signed, touched.pools) == ([], [])


def test_send_refuses_an_owner_secret_that_is_not_the_configured_owners(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With config.toml's owner changed to another key, `send` exits 2 naming both keys, before signing or
    opening a relay (the daemon would refuse what it signed as not the owner's, and no answer would come);
    a key the whitelist names is accepted, as the daemon accepts it."""
    config = home / "config.toml"
    settings = load_settings(home)
    assert settings.owner is not None
    other = KeyPair.from_seed(77).pubkey
    config.write_text(config.read_text(encoding="utf-8").replace(settings.owner, other), encoding="utf-8")
    touched = Touched(monkeypatch)

    code, said = tenexd(home, "send", "hi", "--to", "planner")

    assert code == 2
    assert f"is {settings.owner}, but the owner in {config} is {other}" in said
    assert (touched.signed, touched.pools) == ([], [])
    # whitelisted, the key is one the daemon answers: send goes on (to the relay nobody runs here)
    text = config.read_text(encoding="utf-8")
    config.write_text(text.replace("whitelist = []", f'whitelist = ["{settings.owner}"]'), encoding="utf-8")
    assert "but the owner in" not in tenexd(home, "send", "hi", "--to", "planner")[1]
    assert touched.pools
