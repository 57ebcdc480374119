"""``add_agent`` refused after its key file was written: the home is left as it was, and the refusal's own
error is the one raised, even when putting config.toml back fails too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenex_daemon.app import home as home_module
from tenex_daemon.app.home import HomeError, add_agent, init_home
from tenex_daemon.app.settings import SettingsError, load_settings
from tenex_daemon.testing import KeyPair

OWNER = KeyPair.from_seed(902)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home made by :func:`init_home`."""
    path = tmp_path / "home"
    init_home(path, OWNER.npub, relays=["ws://127.0.0.1:1"])
    return path


def test_a_failed_restore_of_the_config_still_removes_the_key_and_the_first_error_is_raised(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the new config.toml was written but does not load and writing the old one back fails, the new
    key file is removed all the same and the load's SettingsError (not the restore's OSError) is raised."""
    settings = load_settings(home)
    real_write = home_module._write_atomic
    calls: list[str] = []

    def write_once(path: Path, text: str, mode: int = 0o600) -> None:
        calls.append(text)
        if len(calls) > 1:
            raise PermissionError(13, "Permission denied", str(path))
        real_write(path, text, mode)

    def refuse(home: Path) -> None:
        raise SettingsError("refused as it loads")

    monkeypatch.setattr(home_module, "_write_atomic", write_once)
    monkeypatch.setattr(home_module, "load_settings", refuse)

    with pytest.raises(SettingsError, match="refused as it loads"):
        add_agent(settings, "writer", "Writer")

    assert len(calls) == 2  # the new config, then the old one put back (which failed)
    assert not settings.agent_key_path("writer").exists()


@pytest.mark.parametrize("field", ["name", "instructions", "role", "source"])
def test_agent_text_not_utf8_is_refused_before_the_key_is_written(home: Path, field: str) -> None:
    """An agent's name, instructions, role or source that cannot be written as UTF-8 (a lone surrogate, as
    from a definition's JSON escape) is a HomeError naming the field, and no key file is written."""
    settings = load_settings(home)
    bad = {field: "bad \udcff"}

    with pytest.raises(HomeError, match=f"the agent's {field}: the text is not valid UTF-8"):
        add_agent(settings, "writer", bad.get("name", "Writer"), bad.get("instructions", ""),
                  role=bad.get("role"), source=bad.get("source"))

    assert not settings.agent_key_path("writer").exists()
