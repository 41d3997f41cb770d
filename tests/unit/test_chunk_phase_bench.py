"""scripts/bench/chunk_phase.py runs end to end on a small dataset and refuses bad input in one
line (the benchmark of docs/substitutable-reads.md "Jobs out of phase")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "chunk_phase.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120)


def test_prints_a_row_per_phase_with_the_phase_it_measured():
    done = _run("--files", "300", "--epochs", "4", "--seeds", "1", "--phases", "0,0.3")
    assert done.returncode == 0, done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        cells = line.split()
        if len(cells) == 8 and cells[0].replace(".", "", 1).isdigit():
            rows[float(cells[0])] = [float(c) for c in cells]
    assert sorted(rows) == [0.0, 0.3]
    assert rows[0.0][1] == 0.0 and 0.2 < rows[0.3][1] < 0.4  # measured from the epoch starts
    assert rows[0.3][6] == 0.63  # 3 phi (1 - phi)
    assert all(0.5 < row[7] < 2.0 for row in rows.values())  # datasets fetched per epoch


def test_bad_phases_are_refused_in_one_line():
    for bad in ("1.5", "x", ""):
        done = _run("--phases", bad)
        assert done.returncode == 2
        assert "Traceback" not in done.stderr
        assert "--phases" in done.stderr.splitlines()[-1]
