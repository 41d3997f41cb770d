"""``quiverfs plan stagger`` and ``quiverfs run``: plan when jobs sharing a dataset start, and act on it.

A thin layer over :mod:`quiverfs.plan.stagger` (the model), :mod:`quiverfs.plan.calibrate`
(measuring the profiles through a mount) and :mod:`quiverfs.plan.start_record` (when the first
job started); :func:`register` adds the commands to the ``quiverfs`` app (quiverfs/cli/main.py
calls it). docs/staggering.md is the user's guide.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import typer

from quiverfs.base.errors import UsageError
from quiverfs.plan import start_record
from quiverfs.plan.stagger import Plan, Profile, plan

#: ``--job`` keys of a profile given as numbers, and the Profile field each sets.
NUMBER_KEYS = {"iters": "iterations", "iterations": "iterations", "epochs": "epochs",
               "compute": "compute", "wait": "wait", "cached": "wait_cached",
               "wait_cached": "wait_cached", "conc": "wait_conc", "wait_conc": "wait_conc",
               "gpus": "gpus"}

#: ``--job`` keys of a job to calibrate through a mount (quiverfs.plan.calibrate.ReaderJob fields).
READER_KEYS = {"compute": "compute", "batch": "batch", "workers": "workers", "epochs": "epochs",
               "gpus": "gpus", "seed": "seed"}

_INTS = {"iterations", "epochs", "gpus", "batch", "workers", "seed"}


def parse_percent(text: str, what: str) -> float:
    """``"40%"`` or ``"40"`` → 0.4."""
    value = text.strip().removesuffix("%")
    try:
        number = float(value)
    except ValueError:
        raise UsageError(f"{what} must be a percentage like 40%, not {text!r}") from None
    if not math.isfinite(number) or number < 0:
        raise UsageError(f"{what} must be a percentage >= 0, not {text!r}")
    return number / 100


def parse_job(text: str, keys: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """``NAME:key=value,key=value`` → (name, {field: number})."""
    name, colon, rest = text.partition(":")
    if not colon or not name.strip():
        raise UsageError(f"--job must look like NAME:key=value,...; not {text!r}")
    fields: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in keys:
            raise UsageError(f"--job {name}: unknown or malformed {item!r} (keys: {', '.join(sorted(keys))})")
        field = keys[key]
        try:
            number = int(value) if field in _INTS else float(value)
        except ValueError:
            kind = "a whole number" if field in _INTS else "a number of seconds"
            raise UsageError(f"--job {name}: {key} must be {kind}, not {value!r}") from None
        fields[field] = number
    return name.strip(), fields


def profile_from(name: str, fields: dict[str, Any]) -> Profile:
    """A :class:`Profile` from ``--job`` numbers (``epochs`` and ``gpus`` default to 1)."""
    needed = {"iterations", "compute", "wait", "wait_cached", "wait_conc"}
    missing = sorted(needed - set(fields))
    if missing:
        names = {v: k for k, v in NUMBER_KEYS.items() if k in ("iters", "compute", "wait", "cached", "conc")}
        raise UsageError(f"--job {name}: missing {', '.join(names[m] for m in missing)}")
    return Profile(name, fields["iterations"], fields.get("epochs", 1), fields["compute"],
                   fields["wait"], fields["wait_cached"], fields["wait_conc"], fields.get("gpus", 1))


def profiles_from_file(path: Path) -> list[Profile]:
    """Profiles from a JSON file: ``{"jobs": [{name, iterations, ...}, ...]}`` (what
    ``plan stagger --json`` prints, so a calibration can be kept and reused) or a bare list."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise UsageError(f"{path} is not JSON: {exc}") from exc
    jobs = data.get("jobs") if isinstance(data, dict) else data
    if not isinstance(jobs, list) or not all(isinstance(j, dict) for j in jobs):
        raise UsageError(f"{path}: expected {{\"jobs\": [{{...}}, ...]}}")
    out = []
    for i, job in enumerate(jobs):
        try:
            out.append(Profile(**job))
        except TypeError as exc:
            raise UsageError(f"{path}: job {i + 1}: {exc}") from exc
    return out


def format_plan(result: Plan) -> str:
    """The human table: one row per stagger, the optimum marked, then the summary lines."""
    names = [p.name for p in result.profiles]
    lines = [f"{'stagger':>8}  {'makespan':>10}  {'GPU time':>10}  " + "  ".join(f"{n + ' ends':>12}" for n in names)]
    for o in result.table:
        mark = "  <- optimum" if math.isclose(o.stagger, result.optimum.stagger) else ""
        ends = "  ".join(f"{f:>11.1f}s" for f in o.finishes)
        lines.append(f"{o.stagger:>8.0%}  {o.makespan:>9.1f}s  {o.gpu_seconds:>9.1f}s  {ends}{mark}")
    opt, sim = result.optimum, result.simultaneous
    lines += [
        "",
        f"first job alone: {result.profiles[0].standalone():.1f}s (100%)",
        f"optimum (binary search, {result.evaluations} predictions, makespans within "
        f"{result.tolerance:.1%} equal): stagger {opt.stagger:.0%} "
        f"= start {names[1]} {opt.starts[1]:.1f}s after {names[0]}; "
        f"exhaustive sweep: {result.exhaustive.stagger:.0%}",
        f"makespan {opt.makespan:.1f}s vs {sim.makespan:.1f}s simultaneous "
        f"({result.makespan_ratio:.3f}x); GPU time saved {result.gpu_saved:.1f}s "
        f"({result.gpu_saved / sim.gpu_seconds:.1%})" if sim.gpu_seconds else "",
    ]
    return "\n".join(lines)


def _calibrated(mountpoint: Path, specs: list[str], commands: list[str], iterations: int,
                cache_dir: Path | None) -> list[Profile]:
    from mountd.rpc.client import SyncClient, resolve_socket
    from quiverfs.plan.calibrate import ReaderJob, calibrate, mount_files

    try:
        dataset = os.getxattr(mountpoint, "user.quiver.dataset").decode()
    except OSError as exc:
        raise UsageError(f"{mountpoint} is not a quiverfs mount ({os.strerror(exc.errno or 0)})") from None
    jobs: dict[str, ReaderJob] = {}
    for spec in specs:
        name, fields = parse_job(spec, READER_KEYS)
        jobs[name] = ReaderJob(name, **fields)
    for item in commands:
        name, eq, command = item.partition("=")
        if not eq or not command.strip():
            raise UsageError(f"--reader-cmd must look like NAME=COMMAND, not {item!r}")
        base = jobs.get(name, ReaderJob(name))
        jobs[name] = ReaderJob(**{**base.__dict__, "command": command})
    socket = resolve_socket(cache_dir)[0]

    def evict() -> None:
        with SyncClient.connect(socket) as client:
            client.evict(dataset)

    result = calibrate(list(jobs.values()), mountpoint, mount_files(mountpoint), evict,
                       iterations=iterations)
    return result.profiles


def register(app: typer.Typer) -> None:
    """Add ``plan stagger`` and ``run`` to the ``quiverfs`` app."""
    plan_app = typer.Typer(help="Plan how jobs share the cache.", no_args_is_help=True)
    app.add_typer(plan_app, name="plan")

    @plan_app.command("stagger")
    def stagger_command(
        job: list[str] = typer.Option(
            [], "--job", metavar="NAME:KEY=V,...",
            help="A job, first job first. As numbers: iters=N_E,compute=I,wait=W,cached=W_cached,"
                 "conc=W_conc[,epochs=E,gpus=G] (seconds per mini-batch). With --mount: the "
                 "built-in reader's compute=S,batch=N,workers=N[,epochs=E,gpus=G,seed=S].",
        ),
        profiles: Path | None = typer.Option(
            None, "--profiles", metavar="FILE",
            help="Profiles as JSON ({\"jobs\": [...]}, e.g. an earlier `plan stagger --json`).",
        ),
        mount: Path | None = typer.Option(
            None, "--mount", metavar="MOUNT",
            help="Measure the profiles through this mount: each job cold, warm, then all together cold (evicts the dataset's cached files; root or mountd's user).",
        ),
        reader_cmd: list[str] = typer.Option(
            [], "--reader-cmd", metavar="NAME=COMMAND",
            help="With --mount: time this shell command as job NAME's pass instead of the built-in reader (it must do --iters mini-batches).",
        ),
        iters: int = typer.Option(20, "--iters", metavar="K", help="With --mount: mini-batches per calibration pass."),
        cache_dir: Path | None = typer.Option(None, "--cache-dir", readable=False,
                                              help="With --mount: mountd's cache directory."),
        step: str = typer.Option("10%", "--step", help="Stagger step of the table and the search grid."),
        top: str = typer.Option("100%", "--max", help="Largest stagger considered."),
        tolerance: str = typer.Option(
            "1%", "--tolerance",
            help="Makespans this close to the shortest count as equal; the latest such stagger wins (it frees the GPUs longest). 0: the paper's exact minimum.",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """Predict the makespan of jobs sharing a dataset for each stagger, the optimum and the GPU time it saves (HiPC'23 model).

        A stagger of 40% starts the second job when 40% of the first job's standalone runtime has passed (job k: k x 40%).

        Example: quiverfs plan stagger --job A:iters=1560,compute=0.30,wait=0.45,cached=0.05,conc=0.70 --job B:iters=1560,compute=0.20,wait=0.54,cached=0.03,conc=0.80
        """
        step_f, top_f = parse_percent(step, "--step"), parse_percent(top, "--max")
        tolerance_f = parse_percent(tolerance, "--tolerance")
        if mount is not None:
            if profiles is not None:
                raise UsageError("give --mount (measure) or --profiles (numbers), not both")
            found = _calibrated(mount, job, reader_cmd, iters, cache_dir)
        elif reader_cmd:
            raise UsageError("--reader-cmd needs --mount")
        elif profiles is not None:
            if job:
                raise UsageError("give --profiles or --job numbers, not both")
            found = profiles_from_file(profiles)
        else:
            found = [profile_from(*parse_job(spec, NUMBER_KEYS)) for spec in job]
        if len(found) < 2:
            raise UsageError("give at least two jobs (--job twice, --profiles or --mount)")
        result = plan(found, step_f, top_f, tolerance_f)
        if as_json:
            typer.echo(json.dumps(result.to_dict(), indent=2, sort_keys=True))
        else:
            typer.echo(format_plan(result))

    @app.command("run", context_settings={"allow_interspersed_args": False})
    def run_command(
        command: list[str] = typer.Argument(..., metavar="-- CMD [ARGS]...", help="The job to run."),
        first: Path | None = typer.Option(None, "--first", metavar="MOUNT",
                                          help="This is the first job on MOUNT: record its start, then run it."),
        after: Path | None = typer.Option(None, "--after", metavar="MOUNT",
                                          help="Start after the first job on MOUNT, by --stagger."),
        stagger: str | None = typer.Option(None, "--stagger",
                                           help="40% (of the first job's standalone runtime) or 90s."),
        runtime: float | None = typer.Option(None, "--runtime", metavar="SECONDS", min=0,
                                             help="The first job's standalone runtime (for a % stagger)."),
        plan_file: Path | None = typer.Option(None, "--plan", metavar="FILE",
                                              help="A `plan stagger --json` output: its optimum and runtime."),
        wait_first: float = typer.Option(60.0, "--wait-first", metavar="SECONDS", min=0,
                                         help="With --after: how long to wait for a first job to appear."),
        state_dir: Path | None = typer.Option(None, "--state-dir", readable=False,
                                              help="Where start records live (default: $XDG_RUNTIME_DIR/quiverfs/starts or /tmp/quiverfs-UID/starts)."),
    ) -> int:
        """Run a training job as the first job on a mount, or staggered after it.

        The first job: quiverfs run --first MOUNT [--plan plan.json] -- CMD records when it started. A later one: quiverfs run --after MOUNT --stagger 40% -- CMD waits until 40% of the first job's runtime has passed since then (at once if the first job is over). Exit status: CMD's.

        Example: quiverfs run --after /mnt/imagenet --plan plan.json -- python train.py --arch resnet50
        """
        if (first is None) == (after is None):
            raise UsageError("give --first MOUNT or --after MOUNT")
        if not command:
            raise UsageError("give the command after --")
        planned = _plan_numbers(plan_file)
        base = runtime if runtime is not None else planned.get("runtime")
        if first is not None:
            if stagger is not None:
                raise UsageError("--stagger is for --after")
            if not os.path.isdir(first):
                raise UsageError(f"no such directory: {first}")
            return _run_first(first, command, base, state_dir)
        assert after is not None
        fraction, seconds = None, None
        if stagger is None:
            if "stagger" not in planned:
                raise UsageError("--after needs --stagger or --plan")
            fraction = planned["stagger"]
        elif stagger.strip().endswith("s"):
            try:
                seconds = float(stagger.strip()[:-1])
            except ValueError:
                raise UsageError(f"--stagger must be 40% or 90s, not {stagger!r}") from None
            if not math.isfinite(seconds) or seconds < 0:
                raise UsageError(f"--stagger must be 40% or 90s, not {stagger!r}")
        else:
            fraction = parse_percent(stagger, "--stagger")
        at = start_record.planned_start(after, stagger=fraction, seconds=seconds, runtime=base,
                                        state_dir=state_dir, wait_first=wait_first)
        delay = at - time.time()
        if delay > 0:
            print(f"quiverfs run: starting in {delay:.1f}s (the planned stagger after the first job "
                  f"on {os.path.realpath(after)})", file=sys.stderr)
            while (left := at - time.time()) > 0:
                time.sleep(min(left, 1.0))
        return _run_child(command)


def _plan_numbers(path: Path | None) -> dict[str, float]:
    """``{"stagger": fraction, "runtime": seconds}`` from a ``plan stagger --json`` file."""
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
        return {"stagger": float(data["optimum"]["stagger"]),
                "runtime": float(data["first_job_standalone"])}
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"{path} is not the JSON of `quiverfs plan stagger --json`") from None


def _run_child(command: list[str]) -> int:
    """Run ``command``, forwarding SIGTERM and SIGINT; its exit status (128 + signal if killed)."""
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        raise UsageError(f"cannot run {command[0]}: {exc.strerror or exc}") from exc

    def forward(signum: int, frame: Any) -> None:
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def _run_first(mountpoint: Path, command: list[str], runtime: float | None, state_dir: Path | None) -> int:
    """Record the start, then run the job. The record names this process (it lives exactly
    as long as the job, plus the bookkeeping) and is written before the job starts, so a
    job that looks for it (or a ``--after`` started by it) always finds it."""
    start_record.write_start(mountpoint, os.getpid(), runtime, state_dir)
    try:
        return _run_child(command)
    finally:
        start_record.mark_ended(mountpoint, os.getpid(), state_dir)
