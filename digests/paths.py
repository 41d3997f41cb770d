"""Relative POSIX paths as a digest allows them, checked the same way in Python and SQL.

A path is a non-empty ``/``-separated sequence of components; each component is non-empty,
not ``.`` or ``..``, has no NUL byte and is at most :data:`NAME_MAX` bytes of UTF-8 (the
kernel refuses longer names, so a mount could never serve them). No leading or trailing ``/``.
"""

from __future__ import annotations

#: Longest component in UTF-8 bytes (Linux NAME_MAX).
NAME_MAX = 255


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
    return None


def components_key(path: str) -> list[bytes]:
    """Sort key of the canonical order: the path's components as UTF-8 byte strings."""
    return path.encode("utf-8").split(b"/")


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
