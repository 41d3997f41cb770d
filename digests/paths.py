"""Relative POSIX paths as a digest allows them, checked the same way in Python and SQL.

A path is a non-empty ``/``-separated sequence of components; each component is non-empty,
not ``.`` or ``..``, has no NUL byte and is at most :data:`NAME_MAX` bytes of UTF-8 (the
kernel refuses longer names, so a mount could never serve them). No leading or trailing ``/``.
A whole path is at most :data:`PATH_MAX` bytes, which also bounds the depth of a tree (every
component takes at least two bytes with its ``/``): a hostile 20,000-deep digest would
otherwise make every process that walks it hold megabytes of paths per directory.
"""

from __future__ import annotations

#: Longest component in UTF-8 bytes (Linux NAME_MAX).
NAME_MAX = 255

#: Longest relative path in UTF-8 bytes, directories and files alike (Linux PATH_MAX).
PATH_MAX = 4096


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be one path component, or ``None`` when it can."""
    if name == "":
        return "empty path component"
    if name in (".", ".."):
        return f"path component {name!r} is not allowed"
    if "/" in name:
        return "'/' inside a name"
    if "\0" in name:
        return "NUL byte in path"
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return "path is not valid UTF-8"
    if len(encoded) > NAME_MAX:
        return f"path component longer than {NAME_MAX} bytes"
    return None


def path_problem(path: str) -> str | None:
    """Why ``path`` is not a valid relative digest path, or ``None`` when it is."""
    if path == "":
        return "empty path"
    if path.startswith("/"):
        return "absolute path"
    for part in path.split("/"):
        problem = name_problem(part)
        if problem:
            return problem
    # A character is at most 4 bytes: short paths skip the encoding.
    if len(path) > PATH_MAX // 4 and len(path.encode("utf-8")) > PATH_MAX:
        return f"path longer than {PATH_MAX} bytes"
    return None


def components_key(path: str) -> list[bytes]:
    """Sort key of the canonical order: the path's components as UTF-8 byte strings."""
    return path.encode("utf-8").split(b"/")


def bad_utf8(data: bytes) -> int:
    """1 when ``data`` is not valid UTF-8 (lone surrogates included), else 0.

    Registered in SQLite as ``bad_utf8(blob)`` by :mod:`digests.validate`: SQLite stores TEXT
    as given and never checks it, and Python's sqlite3 fails on the first row it cannot decode.
    """
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return 1
    return 0


#: SQL that is true when TEXT column ``{c}`` holds bytes that are not valid UTF-8 (one Python
#: call a row: use it on few rows).
BAD_UTF8_SQL = "(typeof({c}) = 'text' AND bad_utf8(CAST({c} AS BLOB)))"

#: SQL that is non-NULL (a reason) when column ``{c}`` is not a valid name; mirrors
#: :func:`name_problem`. ``instr`` on a BLOB compares bytes, so it sees a NUL that text
#: functions would stop at.
NAME_PROBLEM_SQL = """CASE
    WHEN typeof({c}) != 'text' THEN 'name is not text'
    WHEN {c} = '' THEN 'empty path component'
    WHEN {c} IN ('.', '..') THEN 'path component ' || quote({c}) || ' is not allowed'
    WHEN instr(CAST({c} AS BLOB), X'00') > 0 THEN 'NUL byte in path'
    WHEN instr({c}, '/') > 0 THEN '''/'' inside a name'
    WHEN length(CAST({c} AS BLOB)) > 255 THEN 'path component longer than 255 bytes'
END"""
