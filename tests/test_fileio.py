"""Atomic writes: the old file survives a failed write, and no temp file is left behind."""

import os

import pytest

from minimind_lib.fileio import atomic_open, atomic_write_text


def test_write_replaces_whole_file_readable_by_all(tmp_path):
    path = tmp_path / "sub" / "a.json"
    atomic_write_text(path, "old")
    with atomic_open(path, "wb") as f:
        f.write(b"new")
    assert path.read_bytes() == b"new"
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["a.json"]


def test_failed_write_keeps_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "a.txt"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_open(path, "w", encoding="utf-8") as f:
            f.write("half")
            raise RuntimeError("boom")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_append_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be 'w' or 'wb', got 'a'"):
        with atomic_open("x", "a"):
            pass
