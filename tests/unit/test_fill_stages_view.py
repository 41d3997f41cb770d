"""`quiverfs stats`' fill stages table, and its line on a cache filesystem that is slow to
create files (measured on the GPU machines' root ext4, 2026-11-30: 20× a fresh one)."""

from __future__ import annotations

from rich.console import Console

from quiverfs.cli.mountd_views import SLOW_CREATE_FILLS, print_fill_stages, slow_file_creation


def stages(fills: int, write_cpu_ms: float, rename_cpu_ms: float) -> dict:
    def stage(cpu_ms: float) -> dict:
        return {"count": fills, "wall_s": fills * cpu_ms * 1.5e-3, "cpu_s": fills * cpu_ms * 1e-3}

    return {"jobs": fills // 8, "stages": {
        "rpc": {"count": 0, "wall_s": 0.0, "cpu_s": 0.0},
        "read": stage(0.04), "hash": stage(0.035),
        "write": stage(write_cpu_ms), "rename": stage(rename_cpu_ms),
        "index": {"count": fills, "wall_s": fills * 3e-5, "cpu_s": fills * 2.5e-5}}}


def shown(report: dict) -> str:
    console = Console(record=True, width=300)
    print_fill_stages(report, console)
    return console.export_text()


def test_a_slow_filesystem_is_named_with_its_cost() -> None:
    report = stages(16_000, 0.968, 1.817)  # the GPU machine's root ext4 after a deleted cache
    assert abs(slow_file_creation(report) - 2.785e-3) < 1e-9
    text = shown(report)
    assert "write" in text and "968 µs" in text and "1,817 µs" in text
    assert ("creating cache files is slow: a fill's write and rename cost 2.79 ms of CPU "
            "(~0.15 ms on a fresh filesystem)") in text


def test_a_fresh_filesystem_or_too_few_fills_say_nothing() -> None:
    fresh = stages(16_000, 0.074, 0.071)
    assert slow_file_creation(fresh) is None
    assert "slow" not in shown(fresh)
    early = stages(SLOW_CREATE_FILLS - 1, 2.0, 2.0)  # the first fills open fan-out folders
    assert slow_file_creation(early) is None
    assert abs(slow_file_creation(stages(SLOW_CREATE_FILLS, 2.0, 2.0)) - 4e-3) < 1e-12
