"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from quiverfs.testing.users import LocalUsers, unavailable_reason


@pytest.fixture(scope="session")
def local_users() -> Iterator[LocalUsers]:
    """Makes throwaway local users and groups (names ``qfs_test_*``) for tests of what other
    users of the machine can do; all are removed when the session ends. Skips without root.

    ``local_users.user("qfs_test_other")``, ``local_users.group("qfs_test_socket")``,
    ``local_users.user("qfs_test_member", groups=[group])``; then ``user.probe(...)`` or
    ``user.run([...])`` (quiverfs/testing/users.py)."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with LocalUsers() as users:
        yield users
