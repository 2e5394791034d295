"""The one atomic writer (simulator/readers/files.py) every output goes through."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pipescope.simulator.readers.files import read_small_text, write_atomic


def test_write_atomic_creates_folders_replaces_and_shares(tmp_path: Path) -> None:
    """Parents are created, an old file is replaced, text is UTF-8, the mode is 0644 and no temp file is left."""
    path = tmp_path / "a" / "b" / "out.txt"
    write_atomic(path, b"old")
    write_atomic(str(path), "naïve\n")
    assert path.read_bytes() == "naïve\n".encode()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert os.listdir(path.parent) == ["out.txt"]


def test_write_atomic_makes_the_folders_a_path_walks_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sub/../x.csv`` with no ``sub`` is written where the OS resolves it (it failed with ENOENT at the rename);
    a bare file name goes in the working folder."""
    monkeypatch.chdir(tmp_path)
    write_atomic(os.path.join("sub", "..", "x.csv"), "x")
    write_atomic("y.csv", "y")
    assert (tmp_path / "x.csv").read_text() == "x" and (tmp_path / "sub").is_dir()
    assert (tmp_path / "y.csv").read_text() == "y"


def test_write_atomic_error_names_the_target(tmp_path: Path) -> None:
    """An OSError names the path asked for, not the temporary file."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError) as info:
        write_atomic(blocker / "out.csv", "x")  # the parent is a file
    assert info.value.filename == str(blocker / "out.csv")


def test_a_fifo_or_a_folder_is_refused_before_it_is_opened(tmp_path: Path) -> None:
    """Opening a FIFO blocks until a writer comes (``model.from_hf`` pointed at one hung); a folder or a device is no
    file to read either: one line naming it, before any open."""
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path):
        with pytest.raises(ValueError, match=r"^x: not a regular file \(a folder, FIFO or device\), expected a JSON "
                                             r"file$"):
            read_small_text(str(path), 100, "x", "small", "JSON")
