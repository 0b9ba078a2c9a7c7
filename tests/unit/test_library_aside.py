"""`library.remove_if_same_file` across a crash: the library file it set aside to check is put
back by the next call, and no temp-file cleanup takes it meanwhile (no services)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proj.acquisition import library


def test_a_library_file_set_aside_by_a_call_that_died_is_put_back_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "film.mkv"
    path.write_bytes(b"the library's file")
    other = tmp_path / "copy-elsewhere"
    other.write_bytes(b"the copy a relocate made, since moved on")
    copy = library.file_id(other)  # not the file at `path`: it must stay

    def died(*_: object) -> None:
        raise RuntimeError("killed between setting it aside and putting it back")

    monkeypatch.setattr(library.os, "link", died)
    with pytest.raises(RuntimeError):
        library.remove_if_same_file(path, copy["dev"], copy["ino"])
    monkeypatch.undo()
    assert not path.exists()  # the window: the file is under its aside name

    library.remove_temp_files(path)  # the next copy attempt's cleanup
    assert library.remove_if_same_file(path, copy["dev"], copy["ino"]) is False
    assert path.read_bytes() == b"the library's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy-elsewhere", "film.mkv"]


def test_the_copy_set_aside_by_a_call_that_died_is_removed_by_the_next(tmp_path: Path) -> None:
    path = tmp_path / "film.mkv"
    path.write_bytes(b"the copy")
    copy = library.file_id(path)
    path.rename(library.aside_path(path, copy["dev"], copy["ino"]))  # where the dead call left it

    assert library.remove_if_same_file(path, copy["dev"], copy["ino"]) is True
    assert list(tmp_path.iterdir()) == []
