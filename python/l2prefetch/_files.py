"""Files a user names (profiles, plans, shapes, configs, outputs), read and written safely.

Every path the Python side opens for a user goes through here:

* :func:`read_bytes` / :func:`read_text` open with ``O_NONBLOCK`` (a FIFO or
  a device cannot block the open), ``fstat`` the open descriptor and read only
  a regular file, up to a size limit.  A link the user names is followed (a
  profile may be a link to a versioned file; a Hugging Face snapshot is links
  into its blobs): what is read must still be a regular file.
* :func:`check_output` says, before any work, whether a path can take an
  output (its directory exists and takes a new file; nothing but a regular
  file or a link is in the way), by creating and removing the temporary file
  :func:`write_atomic` would use.
* :func:`check_outputs` is :func:`check_output` for each output of a command,
  refusing two outputs that name one file, or an output that names a file the
  command reads (``trace --profile P --out P`` would replace the profile).
* :func:`write_atomic` writes a new file beside the target with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a link planted at the temporary name is
  refused, never written through) and renames it over the target, so a reader
  never sees half a file; a link at the target is replaced, not followed.
* :func:`loads_json` parses JSON refusing what a writer of ours never makes:
  a key twice in one object (``json`` would keep the last silently) and an
  integer of more digits than Python converts (whose own error names no
  field), each named by its place in the document.

Errors are ``ValueError`` naming the file and what to do (``OSError`` for a
missing file or a permission the system refuses, with the path in it).
Importing this module imports neither torch nor the C extension.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import stat
import sys
import threading
from collections.abc import Sequence
from typing import Any, Union

__all__ = ["check_output", "check_outputs", "check_regular", "files_named", "loads_json",
           "open_regular", "read_bytes", "read_text", "stdout_to_devnull", "write_atomic"]

PathLike = Union[str, "os.PathLike[str]"]

#: The most a profile, plan, shapes file or config may be (a profile of a
#: 61-layer model with all its measurements is well under 10 MiB).
MAX_BYTES = 64 << 20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a link"))


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _path(path: object, what: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"the {what} must be a path (str or os.PathLike), "
                        f"got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        text = os.fsdecode(text)
    if not text:
        raise ValueError(f"the {what} path is empty")
    if "\0" in text:
        raise ValueError(f"the {what} path {text!r} holds a NUL character")
    return text


def _limit(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 and not limit % (1 << 20) else f"{limit} bytes"


def open_regular(path: PathLike, what: str) -> tuple[int, os.stat_result]:
    """``(fd, stat)`` of the regular file at ``path``, opened read-only; the caller
    closes ``fd``.  Anything else (a FIFO, a directory, a device) is a ValueError,
    refused before it is opened where it is one already (opening a device can act), and
    checked again on the descriptor (the name may have changed in between)."""
    where = _path(path, what)
    _regular(os.stat(where), where, what)   # before opening it: opening a device can act
    fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        _regular(info, where, what)   # again: the name may lead elsewhere by now
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def _regular(info: os.stat_result, where: str, what: str) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} {where} is {_kind(info.st_mode)}, not a regular file: "
                         f"pass the path of the {what} itself")


def read_bytes(path: PathLike, what: str, *, limit: int = MAX_BYTES) -> bytes:
    """The bytes of the regular file at ``path`` (at most ``limit``); ``what`` names it
    in errors ("profile", "shapes file")."""
    where = _path(path, what)
    fd, info = open_regular(where, what)
    try:
        if info.st_size > limit:
            raise ValueError(f"{what} {where} is {info.st_size} bytes, more than the "
                             f"{_limit(limit)} a {what} can be: is it the right file?")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # the file grew while being read
                raise ValueError(f"{what} {where} is more than the {_limit(limit)} a "
                                 f"{what} can be: is it the right file?")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: PathLike, what: str, *, limit: int = MAX_BYTES) -> str:
    """:func:`read_bytes` decoded as UTF-8 (a ValueError naming the file otherwise)."""
    data = read_bytes(path, what, limit=limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {os.fspath(path)} is not UTF-8 text (byte {exc.start}): "
                         f"is it the right file?") from None


def check_regular(path: PathLike, what: str) -> None:
    """Raise unless ``path`` opens as a regular file (without reading it)."""
    os.close(open_regular(path, what)[0])


def _temporary(target: str) -> str:
    """The temporary name beside ``target``: its process's (``.NAME.PID.tmp``), and in
    a thread other than the main one also its thread's (``.NAME.PID-TID.tmp``), so
    that two writers of one file, processes or threads, never take each other's for a
    file left behind; the rename makes the last one whole in place."""
    head, tail = os.path.split(target)
    who = str(os.getpid())
    if threading.current_thread() is not threading.main_thread():
        who += f"-{threading.get_ident()}"
    return os.path.join(head, f".{tail}.{who}.tmp")


def _create(tmp: str) -> int:
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   0o666)


def check_output(path: PathLike, what: str) -> str:
    """Raise (ValueError naming ``what``, the path and the fix) unless ``path`` can take
    an output; returns the path as a str."""
    target = _path(path, what)
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise ValueError(f"{what} {target} cannot be written: {exc.strerror}") from None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise ValueError(f"{what} {target} is {_kind(mode)}: name a file to write")
    directory = os.path.dirname(target) or "."
    if not os.path.isdir(directory):
        raise ValueError(f"{what} {target} cannot be written: {directory} is not a directory "
                         "(create it first)")
    tmp = _temporary(target)
    try:
        os.close(_create(tmp))
    except FileExistsError:
        raise ValueError(f"{what} {target} cannot be written: {tmp} is in the way (a link or "
                         "a file left behind; remove it)") from None
    except OSError as exc:
        raise ValueError(f"{what} {target} cannot be written: {exc.strerror} in "
                         f"{directory}") from None
    os.unlink(tmp)
    return target


def files_named(source: str, what: str) -> list[tuple[str, str]]:
    """The files a path names, as :func:`check_outputs`' inputs: the file, or a
    directory's files (tune's and trace's MODEL: no output may be one of them); none for a
    name that is no path (a model type)."""
    if os.path.isdir(source):
        return [(what, os.path.join(source, name)) for name in sorted(os.listdir(source))]
    return [(what, source)] if os.path.lexists(source) else []


def check_outputs(outputs: Sequence[tuple[str, PathLike]],
                  inputs: Sequence[tuple[str, PathLike]] = ()) -> list[str]:
    """:func:`check_output` for each ``(what, path)`` of ``outputs``, and that no two of
    them, and none of them and an ``(what, path)`` of ``inputs``, name one file (after
    links: a link to the input is that input); the paths as str, or a ValueError naming
    both and the fix."""
    read: dict[str, str] = {}
    for what, path in inputs:
        read.setdefault(os.path.realpath(_path(path, what)), what)
    written: dict[str, str] = {}
    out = []
    for what, path in outputs:
        target = check_output(path, what)
        real = os.path.realpath(target)
        if real in read:
            raise ValueError(f"{what} {target} is the file {read[real]} reads: writing it "
                             f"would replace what {read[real]} names; name another file")
        if real in written:
            raise ValueError(f"{what} {target} is the file {written[real]} names too: give "
                             "each output its own file")
        written[real] = what
        out.append(target)
    return out


def stdout_to_devnull() -> None:
    """Point the process's stdout at /dev/null, so that the interpreter's flush at exit,
    into a pipe its reader closed, raises nothing (the Python docs' advice for SIGPIPE);
    nothing where stdout is no file descriptor (a test's capture)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass
    finally:
        os.close(devnull)


def _sync(fd: int) -> None:
    """fsync, where the file system has it (some FUSE and 9p mounts answer EINVAL)."""
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise


def _sync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable, where the file system lets a directory be
    opened and synced (not every one does: then the rename stands unsynced)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: PathLike, data: Union[str, bytes], what: str) -> None:
    """Write ``data`` (str: UTF-8) to ``path`` through a new temporary file, synced and
    renamed into place; nothing is left behind on failure."""
    target = _path(path, what)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    tmp = _temporary(target)
    try:
        fd = _create(tmp)
    except FileExistsError:
        raise ValueError(f"{what} {target} cannot be written: {tmp} is in the way (a link or "
                         "a file left behind; remove it)") from None
    try:
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            _sync(fd)   # the bytes on disk before the name: a crash leaves old or new
        finally:
            os.close(fd)
        os.replace(tmp, target)
        _sync_directory(os.path.dirname(target) or ".")
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# -- JSON ---------------------------------------------------------------------------------------

class _Duplicated(dict):
    """A JSON object that gave some key more than once (``keys``)."""

    keys_given_twice: list


class _LongNumber:
    """An integer literal of more digits than Python converts, kept to be named."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<a {self.digits}-digit number>"


class _NonFinite:
    """A NaN, Infinity or -Infinity literal, or a number too large for a float (1e400),
    kept to be named."""

    def __init__(self, name: str, why: str = "which JSON does not have") -> None:
        self.name, self.why = name, why

    def __repr__(self) -> str:
        return self.name


#: Python's default limit on the digits of an int parsed from text (sys.int_info).
_MAX_DIGITS = 4300


def _pairs(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        twice: list = []
        for key, _ in pairs:
            if key in seen and key not in twice:
                twice.append(key)
            seen.add(key)
        out = _Duplicated(out)
        out.keys_given_twice = twice
    return out


def _int(text: str) -> Any:
    digits = len(text) - text.startswith("-")
    return _LongNumber(digits) if digits > _MAX_DIGITS else int(text)


def _place(link: Any) -> str:
    """``plan[0].byte_cap`` from the linked (parent, key) pairs of :func:`loads_json`."""
    parts = []
    while link is not None:
        link, part = link
        parts.append(part)
    out = ""
    for part in reversed(parts):
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "the top level"


def loads_json(text: Union[str, bytes], where: str, *, finite: bool = True) -> Any:
    """``json.loads``, refusing a key given twice in one object, an integer too long to
    convert and (``finite``) ``NaN``/``Infinity``, which JSON lacks and Python's reader
    takes: ValueError ``"<where>: <place> ..."`` naming the place (``plan[0].byte_cap``).
    ``finite=False`` keeps them as floats, for a caller that refuses them in its words.

    What does not parse raises as ``json.loads`` raises it (``json.JSONDecodeError``,
    ``RecursionError`` for nesting too deep), for the caller to say in its words.
    """
    bad: list = []   # what the hooks found; the walk that names its place runs only then

    def pairs(items: list) -> dict:
        out = _pairs(items)
        if isinstance(out, _Duplicated):
            bad.append(out)
        return out

    def parse_int(digits: str) -> Any:
        if len(digits) <= _MAX_DIGITS:
            return int(digits)
        value = _int(digits)   # a sign and 4300 digits still converts
        if isinstance(value, _LongNumber):
            bad.append(value)
        return value

    def parse_constant(name: str) -> Any:
        value = _NonFinite(name)
        bad.append(value)
        return value

    def parse_float(digits: str) -> Any:
        value = float(digits)
        if math.isfinite(value):
            return value
        named = _NonFinite(digits if len(digits) <= 40 else f"a {len(digits)}-character number",
                           "past the largest float")
        bad.append(named)
        return named

    data = json.loads(text, object_pairs_hook=pairs, parse_int=parse_int,
                      **({"parse_constant": parse_constant, "parse_float": parse_float}
                         if finite else {}))
    if not bad:
        return data
    # A loop, not recursion (the parser nests deeper than a recursive walk can);
    # each place is a (parent, key) link, so the walk costs one pair per value.
    stack: list = [(data, None)]
    while stack:
        value, parts = stack.pop()
        if isinstance(value, _LongNumber):
            raise ValueError(f"{where}: {_place(parts)} is a {value.digits}-digit number; "
                             "no field takes one that long")
        if isinstance(value, _NonFinite):
            raise ValueError(f"{where}: {_place(parts)} is {value.name}, {value.why}; write a "
                             "finite number")
        if isinstance(value, dict):
            if isinstance(value, _Duplicated):
                keys = ", ".join(repr(k) for k in value.keys_given_twice)
                raise ValueError(f"{where}: {_place(parts)} gives the key {keys} more than "
                                 "once (JSON would keep only the last); keep one")
            stack.extend((v, (parts, k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, (parts, i)) for i, v in enumerate(value))
    return data
