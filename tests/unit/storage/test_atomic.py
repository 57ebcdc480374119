"""The one atomic replacement of a file: temp file, fsync, rename, fsync the folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tenex_daemon.adapters.storage.atomic import put_in_place, replace_file, stage, temp_of


def test_replace_file_puts_the_new_content_in_place_and_returns_its_stamp(tmp_path: Path) -> None:
    """The file holds the new bytes, no temp file stays, and the stamp is the file's (size, mtime)."""
    path = tmp_path / "state.json"
    path.write_bytes(b"old")

    stamp = replace_file(path, b"new content")

    st = os.stat(path)
    assert path.read_bytes() == b"new content"
    assert stamp == (st.st_size, st.st_mtime_ns)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_unique_temp_file_gets_the_exact_mode_asked_for(tmp_path: Path) -> None:
    """With a temp file of its own the result has the requested mode, whatever the umask."""
    path = tmp_path / "config.toml"
    previous = os.umask(0o077)
    try:
        replace_file(path, b"x = 1\n", mode=0o644, unique_temp=True)
    finally:
        os.umask(previous)

    assert path.read_bytes() == b"x = 1\n"
    assert path.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]


@pytest.mark.parametrize("unique_temp", [False, True])
def test_a_failed_replacement_keeps_the_old_file_and_removes_its_temp_file(
    tmp_path: Path, unique_temp: bool
) -> None:
    """A rename that fails (the target is a folder) leaves the target as it was and no temp file."""
    target = tmp_path / "taken"
    target.mkdir()
    (target / "inside").write_bytes(b"kept")

    with pytest.raises(IsADirectoryError):
        replace_file(target, b"never seen", unique_temp=unique_temp)

    assert (target / "inside").read_bytes() == b"kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_a_staged_replacement_is_invisible_until_put_in_place(tmp_path: Path) -> None:
    """stage writes only the temp file; put_in_place renames it over the file, keeping the stamp."""
    path = tmp_path / "value.json"
    path.write_bytes(b"before")

    stamp = stage(path, b"after", durable=False)

    assert path.read_bytes() == b"before"
    assert temp_of(path).read_bytes() == b"after"
    put_in_place(path)
    st = os.stat(path)
    assert path.read_bytes() == b"after"
    assert stamp == (st.st_size, st.st_mtime_ns)
    assert not temp_of(path).exists()
