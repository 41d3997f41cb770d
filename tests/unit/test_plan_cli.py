"""``quiverfs plan stagger`` from numbers and ``quiverfs run --first/--after`` for real, in
subprocesses (the run tests check only orderings and lower bounds, never how fast)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quiverfs.base.errors import UsageError
from quiverfs.plan import start_record

REPO = Path(__file__).resolve().parents[2]

A = "A:iters=1560,compute=0.3036,wait=0.4493,cached=0.05,conc=0.70"
B = "B:iters=1560,compute=0.2047,wait=0.5433,cached=0.03,conc=0.80"


def quiverfs(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    environ = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, "-m", "quiverfs.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=environ)


def test_numbers_in_table_out() -> None:
    result = quiverfs("plan", "stagger", "--job", A, "--job", B)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    staggers = [line.split()[0] for line in lines if line.strip()[:4].strip().rstrip("%").isdigit()]
    assert staggers == [f"{p}%" for p in range(0, 101, 10)]
    (marked,) = [line for line in lines if "<- optimum" in line]
    assert marked.split()[0] == "70%"
    assert "GPU time saved" in result.stdout and "exhaustive sweep: 70%" in result.stdout


def test_json_is_the_model_and_feeds_back_as_profiles(tmp_path: Path) -> None:
    result = quiverfs("plan", "stagger", "--job", A, "--job", B, "--step", "5%", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [j["name"] for j in data["jobs"]] == ["A", "B"]
    assert len(data["table"]) == 21
    assert data["optimum"]["makespan"] < data["simultaneous"]["makespan"]
    assert data["gpu_seconds_saved"] > 0
    assert data["optimum"]["stagger"] == data["exhaustive_optimum"]["stagger"]
    saved = tmp_path / "plan.json"
    saved.write_text(result.stdout)
    again = quiverfs("plan", "stagger", "--profiles", str(saved), "--step", "5%", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["table"] == data["table"]


@pytest.mark.parametrize("args, message", [
    (["--job", "A:iters=15x0,compute=1,wait=1,cached=1,conc=1", "--job", B], "iters must be a whole number"),
    (["--job", "A:iters=10,compute=1,wait=1,cached=1", "--job", B], "missing conc"),
    (["--job", A], "at least two jobs"),
    (["--job", "A:speed=3", "--job", B], "unknown or malformed"),
    (["--job", "noname", "--job", B], "NAME:key=value"),
    (["--job", "A:iters=10,compute=1,wait=-1,cached=1,conc=1", "--job", B], "wait must be"),
    (["--job", A, "--job", B, "--step", "0"], "step must be above 0"),
    (["--job", A, "--job", B, "--step", "ten"], "percentage"),
    (["--profiles", "/nonexistent/plan.json"], "cannot read"),
    (["--job", A, "--reader-cmd", "A=true"], "--reader-cmd needs --mount"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = quiverfs("plan", "stagger", *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("quiverfs: error: ") and message in lines[0], lines


def test_a_profiles_file_that_is_not_ours_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "p.json"
    bad.write_text('{"jobs": [{"name": "A", "speed": 1}]}')
    result = quiverfs("plan", "stagger", "--profiles", str(bad))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "job 1" in result.stderr


# -- quiverfs run --------------------------------------------------------------------------------


def _first_job(tmp_path: Path, directory: Path, state: Path, *extra: str) -> subprocess.Popen:
    """``quiverfs run --first DIR -- sh`` whose job writes its start time, then waits for the
    file ``release`` (so the test decides when it ends)."""
    script = (f'date +%s.%N > {tmp_path}/a-start; '
              f'while [ ! -e {tmp_path}/release ]; do sleep 0.05; done')
    environ = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "quiverfs.cli", "run", "--first", str(directory),
                             "--state-dir", str(state), *extra, "--", "sh", "-c", script],
                            cwd=REPO, env=environ)


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_after_waits_for_the_planned_moment(tmp_path: Path) -> None:
    data, state = tmp_path / "data", tmp_path / "state"
    data.mkdir()
    first = _first_job(tmp_path, data, state, "--runtime", "20")
    try:
        _wait_for(tmp_path / "a-start")
        record = start_record.read_start(data, state)
        assert record is not None and record.runtime == 20 and not record.over
        # 10% of the recorded runtime of 20 s: 2 s after the first job's start.
        second = quiverfs("run", "--after", str(data), "--stagger", "10%", "--state-dir", str(state),
                          "--", "sh", "-c", f"date +%s.%N > {tmp_path}/b-start; exit 7")
        assert second.returncode == 7  # the command's own status
        b_start = float((tmp_path / "b-start").read_text())
        assert b_start >= record.started + 2.0  # never before the planned moment
        assert not (tmp_path / "release").exists()  # and the first job was still running
    finally:
        (tmp_path / "release").touch()
        assert first.wait(timeout=60) == 0
    record = start_record.read_start(data, state)
    assert record is not None and record.over and record.ended is not None


def test_after_a_finished_first_job_starts_at_once(tmp_path: Path) -> None:
    data, state = tmp_path / "data", tmp_path / "state"
    data.mkdir()
    (tmp_path / "release").touch()  # the first job ends as soon as it starts
    first = _first_job(tmp_path, data, state)
    assert first.wait(timeout=60) == 0
    # An hour's stagger, but the first job is over: the planned moment is past.
    second = quiverfs("run", "--after", str(data), "--stagger", "3600s", "--state-dir", str(state),
                      "--", "sh", "-c", f"touch {tmp_path}/b-ran", timeout=60)
    assert second.returncode == 0, second.stderr
    assert (tmp_path / "b-ran").exists()


def test_plan_file_gives_the_stagger_and_runtime(tmp_path: Path) -> None:
    plan = quiverfs("plan", "stagger", "--job", A, "--job", B, "--json")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.stdout)
    data, state = tmp_path / "data", tmp_path / "state"
    data.mkdir()
    start_record.write_start(data, os.getpid(), None, state)  # a live "first job": this test
    record = start_record.read_start(data, state)
    assert record is not None
    at = start_record.planned_start(data, stagger=0.7, runtime=json.loads(plan.stdout)["first_job_standalone"],
                                    state_dir=state)
    assert at == pytest.approx(record.started + 0.7 * 1174.5, abs=0.1)
    with pytest.raises(UsageError, match="runtime"):
        start_record.planned_start(data, stagger=0.5, state_dir=state)
    assert start_record.planned_start(data, seconds=5, state_dir=state) == pytest.approx(record.started + 5)


@pytest.mark.parametrize("args, message", [
    (["--after", "{d}", "--stagger", "10%", "--wait-first", "0", "--", "true"], "no first job"),
    (["--after", "{d}", "--wait-first", "0", "--", "true"], "needs --stagger or --plan"),
    (["--after", "{d}", "--stagger", "fast", "--", "true"], "percentage"),
    (["--first", "{d}", "--after", "{d}", "--", "true"], "--first MOUNT or --after MOUNT"),
    (["--first", "{d}/missing", "--", "true"], "no such directory"),
    (["--first", "{d}", "--", "/nonexistent/cmd"], "cannot run"),
    (["--after", "{d}", "--plan", "{d}/plan.json", "--", "true"], "cannot read"),
])
def test_run_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    state = tmp_path / "state"
    args = [a.format(d=tmp_path) for a in args]
    result = quiverfs("run", "--state-dir", str(state), *args, timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
