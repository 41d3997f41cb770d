"""``digests diff``: which paths two digests add, remove or change, by canonical content.

Locations and creation times are ignored, like the dataset id: two digests of the same data
stored in different places are identical. Empty directories are part of the content (format
version 2): one added or removed is listed with a trailing ``/``, after the files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from digests.digest import Digest
from digests.paths import components_key


@dataclass
class DiffResult:
    """Paths only in B (added), only in A (removed), in both with other size or content."""

    a_id: str
    b_id: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)

    @property
    def same_id(self) -> bool:
        return self.a_id == self.b_id

    @property
    def identical(self) -> bool:
        return self.same_id and not (self.added or self.removed or self.changed)


def diff(a: Digest, b: Digest) -> DiffResult:
    """Compare ``a`` (old) with ``b`` (new), streaming both in canonical order."""
    result = DiffResult(a.dataset_id, b.dataset_id)
    if result.same_id:
        return result
    left, right = a.iter_canonical(), b.iter_canonical()
    x, y = next(left, None), next(right, None)
    while x is not None or y is not None:
        if y is None or (x is not None and components_key(x[0]) < components_key(y[0])):
            result.removed.append(x[0])
            x = next(left, None)
        elif x is None or components_key(y[0]) < components_key(x[0]):
            result.added.append(y[0])
            y = next(right, None)
        else:
            if x[1:] != y[1:]:
                result.changed.append(x[0])
            x, y = next(left, None), next(right, None)
    old_dirs, new_dirs = set(a.empty_dirs()), set(b.empty_dirs())
    result.removed += [f"{p}/" for p in sorted(old_dirs - new_dirs, key=components_key)]
    result.added += [f"{p}/" for p in sorted(new_dirs - old_dirs, key=components_key)]
    return result
