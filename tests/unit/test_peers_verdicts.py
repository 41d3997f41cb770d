"""The side-by-side benchmark's verdicts (scripts/bench/peers/report.py): each follows its
numbers, and the digits printed beside it never say the other thing."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

from peers.report import Row, verdicts  # noqa: E402

DATASET = 1000


def _row(contender: str, cold: float, warm: float, total_bytes: int = DATASET * 2, jobs: int = 1) -> Row:
    return Row("a", contender, jobs, rounds=1, rates=[cold, warm], overall=(cold + warm) / 2,
               total_bytes=total_bytes)


def _verdict(lines: list[str], needle: str) -> str:
    (line,) = [line for line in lines if needle in line]
    return line


def test_a_cold_epoch_just_under_the_target_shows_three_decimals_beside_its_fail() -> None:
    lines = verdicts("a", [_row("qfs-mount", 372.6, 555), _row("mosaic", 414.4, 502)], DATASET, 2)
    cold = _verdict(lines, "qfs-mount: cold epoch")
    assert cold.startswith("FAIL") and "= 0.899 x best other (mosaic 414)" in cold
    warm = _verdict(lines, "qfs-mount: warm epoch")
    assert warm.startswith("PASS") and "= 1.11 x best other" in warm  # far from 1.0: two decimals


def test_a_cold_epoch_just_over_the_target_passes_and_says_so() -> None:
    lines = verdicts("a", [_row("qfs-mount", 373.2, 400), _row("mosaic", 414.4, 502)], DATASET, 2)
    cold = _verdict(lines, "qfs-mount: cold epoch")
    assert cold.startswith("PASS") and "= 0.90 x best other" in cold  # 0.9006: rounds the right way
    assert _verdict(lines, "qfs-mount: warm epoch").startswith("FAIL")


def test_bytes_a_hair_over_the_lowest_other_show_the_digits_that_differ() -> None:
    rows = [Row("b", "qfs-shim", 1, rounds=1, rates=[300, 300], overall=300, total_bytes=2009),
            Row("b", "s3tc-map", 1, rounds=1, rates=[150, 150], overall=150, total_bytes=2000)]
    lines = verdicts("b", rows, DATASET, 2)
    line = _verdict(lines, "bucket bytes per epoch")
    assert line.startswith("FAIL") and "1.004 datasets vs the lowest other (s3tc-map 1.000)" in line
    rows[0].total_bytes = 2000  # the same bytes: PASS, two decimals
    line = _verdict(verdicts("b", rows, DATASET, 2), "bucket bytes per epoch")
    assert line.startswith("PASS") and "1.00 datasets vs the lowest other (s3tc-map 1.00)" in line
