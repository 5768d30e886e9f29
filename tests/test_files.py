"""l2prefetch._files: the one way the Python side opens, writes and parses a user's files
(issue 21: a FIFO must not hang a read, a planted link must not be written through, JSON
must not keep the last of a key given twice)."""

from __future__ import annotations

import json
import os
import re
import socket

import pytest

from l2prefetch import _files


def test_only_regular_files_are_read(tmp_path):
    regular = tmp_path / "f.json"
    regular.write_bytes(b"{}")
    assert _files.read_text(regular, "profile") == "{}"
    link = tmp_path / "link.json"
    os.symlink(regular, link)        # a link the user names is followed to a regular file
    assert _files.read_text(link, "profile") == "{}"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)                  # O_NONBLOCK: the open returns, the fstat refuses it
    with pytest.raises(ValueError, match=r"^profile .*/fifo is a FIFO, not a regular file: "
                                         r"pass the path of the profile itself$"):
        _files.read_text(fifo, "profile")
    with pytest.raises(ValueError, match=r"is a directory, not a regular file"):
        _files.read_bytes(tmp_path, "profile")
    with pytest.raises(ValueError, match=r"/dev/null is a device, not a regular file"):
        _files.read_bytes("/dev/null", "profile")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(tmp_path / "sock"))
        with pytest.raises(ValueError, match=r"/sock is .*, not a regular file"):
            _files.read_bytes(tmp_path / "sock", "profile")   # refused before any open
    finally:
        server.close()
    with pytest.raises(FileNotFoundError):
        _files.read_bytes(tmp_path / "missing", "profile")


def test_reads_are_bounded_and_decoded(tmp_path):
    big = tmp_path / "big"
    big.write_bytes(b"x" * 3000)
    with pytest.raises(ValueError, match=r"is 3000 bytes, more than the 2048 bytes a profile "
                                         r"can be: is it the right file\?"):
        _files.read_bytes(big, "profile", limit=2048)
    assert len(_files.read_bytes(big, "profile", limit=3000)) == 3000
    latin = tmp_path / "latin"
    latin.write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match=r"is not UTF-8 text \(byte 3\)"):
        _files.read_text(latin, "plan")
    for bad, error in ((None, TypeError), ("", ValueError), ("a\0b", ValueError)):
        with pytest.raises(error):
            _files.read_bytes(bad, "profile")


def test_write_atomic_never_follows_a_planted_link_and_leaves_nothing(tmp_path):
    target = tmp_path / "out.json"
    victim = tmp_path / "victim"
    victim.write_text("keep")
    tmp = tmp_path / f".out.json.{os.getpid()}.tmp"
    os.symlink(victim, tmp)
    with pytest.raises(ValueError, match=r"is in the way"):
        _files.write_atomic(target, "new", "profile")
    assert victim.read_text() == "keep" and not target.exists()
    tmp.unlink()
    _files.write_atomic(target, "new", "profile")
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "victim"]
    # a failed rename (the target is a directory) removes the temporary file
    (tmp_path / "dir").mkdir()
    with pytest.raises(OSError):
        _files.write_atomic(tmp_path / "dir", b"x", "profile")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "out.json", "victim"]


def test_check_output_says_what_is_in_the_way(tmp_path):
    assert _files.check_output(tmp_path / "new.json", "--out") == str(tmp_path / "new.json")
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match=r"^--out .*/d is a directory: name a file to write$"):
        _files.check_output(tmp_path / "d", "--out")
    os.mkfifo(tmp_path / "f")
    with pytest.raises(ValueError, match=r"is a FIFO: name a file to write"):
        _files.check_output(tmp_path / "f", "--out")
    with pytest.raises(ValueError, match=r"cannot be written: .*/nowhere is not a directory"):
        _files.check_output(tmp_path / "nowhere" / "x.json", "--out")
    os.symlink(tmp_path / "d", tmp_path / "link")   # a link is replaced, so it may be there
    assert _files.check_output(tmp_path / "link", "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f", "link"]   # nothing left


def test_loads_json_refuses_what_json_would_silently_accept():
    assert _files.loads_json('{"a": [1, {"b": 2}]}', "x") == {"a": [1, {"b": 2}]}
    with pytest.raises(ValueError, match=r"^profile p: a\[1\] gives the key 'b' more than "
                                         r"once \(JSON would keep only the last\); keep one$"):
        _files.loads_json('{"a": [1, {"b": 1, "b": 2}]}', "profile p")
    with pytest.raises(ValueError, match=r"^x: the top level gives the key 'k' more than once"):
        _files.loads_json('{"k": 1, "k": 1}', "x")
    with pytest.raises(ValueError, match=r"^x: a.b\[0\] is a 4301-digit number; no field takes "
                                         r"one that long$"):
        _files.loads_json('{"a": {"b": [-' + "1" * 4301 + "]}}", "x")
    assert _files.loads_json("[" + "9" * 4300 + "]", "x") == [int("9" * 4300)]
    for literal in ("NaN", "-Infinity"):
        with pytest.raises(ValueError, match=r"^x: a\[1\] is %s, which JSON does not have; "
                                             r"write a finite number$" % literal):
            _files.loads_json('{"a": [0.5, %s]}' % literal, "x")
    for number in ("1e400", "-2.5E+309"):   # Python reads them as infinities
        with pytest.raises(ValueError, match=r"^x: eps is %s, past the largest float; write a "
                                             r"finite number$" % re.escape(number)):
            _files.loads_json('{"eps": %s}' % number, "x")
    assert _files.loads_json('[1e-400, 1.7e308]', "x") == [0.0, 1.7e308]
    with pytest.raises(ValueError, match=r"^x: eps is a 5003-character number, past the "
                                         r"largest float; write a finite number$"):
        _files.loads_json('{"eps": 1' + "0" * 5000 + ".0}", "x")
    with pytest.raises(json.JSONDecodeError):
        _files.loads_json("{", "x")
    with pytest.raises(RecursionError):
        _files.loads_json("[" * 100000, "x")
    # a walk of a deep document that the parser took is no recursion
    deep = "[" * 900 + '{"a": 1, "a": 2}' + "]" * 900
    with pytest.raises(ValueError, match=r"\[0\]\[0\].*gives the key 'a'"):
        _files.loads_json(deep, "x")


def test_what_is_no_regular_file_is_refused_before_it_is_opened(tmp_path, monkeypatch):
    """Opening a device can act (a watchdog starts counting, a tape rewinds), and a FIFO
    could block: such a name is refused on its stat, never opened."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **kw: (opened.append(path),
                                                            real_open(path, *a, **kw))[1])
    for path in ("/dev/null", fifo, tmp_path):
        with pytest.raises(ValueError, match="not a regular file"):
            _files.read_bytes(path, "profile")
    assert opened == []
    (tmp_path / "p.json").write_text("{}")
    assert _files.read_text(tmp_path / "p.json", "profile") == "{}" and len(opened) == 1


def test_write_atomic_syncs_the_bytes_before_the_rename(tmp_path, monkeypatch):
    """A crash after the rename must not leave an empty file under the name: the data
    is synced first, then the directory holding the new name."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.path.isdir(
        f"/proc/self/fd/{fd}"))), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", None)),
                                                     real_replace(a, b))[1])
    _files.write_atomic(tmp_path / "p.json", "{}", "profile")
    assert events == [("fsync", False), ("replace", None), ("fsync", True)]
    assert (tmp_path / "p.json").read_text() == "{}"
