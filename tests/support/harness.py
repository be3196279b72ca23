"""Start a real multi-process training job, inject a stop signal, and report what each rank saw.

Launch modes, as users launch jobs:
  * ``independent``: one process per rank, started separately with MASTER_ADDR/MASTER_PORT/
    WORLD_SIZE/NODE_RANK/LOCAL_RANK (SLURM srun, one Kubernetes pod per rank);
  * ``lightning``: one process; Lightning's own launcher (``devices=N``) starts the other ranks;
  * ``torchrun``: ``python -m torch.distributed.run --nproc-per-node N``.

What the job trains is a :class:`scenario.Scenario`, handed to every process as one environment variable
(see scenario.py). Every process the harness starts gets its own process group and a hard timeout, and
every group is killed in ``finally``.

Three environment variables configure the harness itself, so that the same scenarios run against any
environment (stock, patched, older Lightning; the Makefile's test-patched and test-versions set them):
``SCENARIO_PYTHON``, the Python that runs the jobs (default: this one); ``SCENARIO_IMPLEMENTATION``, the fix
that Python has, ``package`` (default) or ``patched``; ``SCENARIO_EXPECT_LIGHTNING``, the Lightning release
every rank must report (helpers.py checks it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from ddp_sigterm_tests.scenario import Job, Scenario

HERE = Path(__file__).resolve().parent  # the support package: the jobs run on every rank are here
SCRIPT = HERE / "scenario_train.py"
PYTHON = os.environ.get("SCENARIO_PYTHON", sys.executable)
IMPLEMENTATION = os.environ.get("SCENARIO_IMPLEMENTATION", "package")
EXPECT_LIGHTNING = os.environ.get("SCENARIO_EXPECT_LIGHTNING")


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on, for a server a job starts (``MASTER_PORT``, a test's HTTP
    server). Drawn below the kernel's ephemeral range: a port the kernel hands out for port 0 is one it also gives
    any process's outgoing connection (gloo makes many), so in the moment before the job listens on it another
    test's job could take it (EADDRINUSE, seen once in make test). Each pytest-xdist worker draws from its own
    slice, so two tests running side by side never draw the same port."""
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    ports = list(range(PORTS_FROM + worker, max(ephemeral, PORTS_FROM + 1000), workers))
    for port in _random.sample(ports, 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or a past job's connection still in TIME_WAIT
                continue
            return port
    raise RuntimeError(f"no free port among 200 tries in {ports[0]}-{ports[-1]}")


PORTS_FROM = 20000
_random = random.Random()  # not the tests' seeded global state


@contextlib.contextmanager
def s3_server(out: Path, bucket: str) -> Iterator[dict[str, str]]:
    """A real S3-compatible server, moto's, on 127.0.0.1 (a session of its own, killed in ``finally``,
    its log in ``out/moto.log``), with ``bucket`` made; yields the environment a job needs to reach it
    through s3fs (``s3://<bucket>/...``)."""
    port = free_port()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
           "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    with open(out / "moto.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    s3_filesystem(env).mkdir(bucket)
                    break
                except Exception:  # not listening yet; after the deadline, the error is raised
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            yield env
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def s3_filesystem(env: dict[str, str]) -> Any:
    """s3fs's file system for the server :func:`s3_server` started (a fresh instance: no cached listing)."""
    import s3fs

    return s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                             endpoint_url=env["AWS_ENDPOINT_URL"], skip_instance_cache=True)


def stop_checkpoints(directory: Path) -> list[Path]:
    """The checkpoints a stop saved in ``directory``: the package's hpc_ckpt_<N>.ckpt, or, with the patched build,
    Lightning's OnExceptionCheckpoint's on_exception.ckpt (which the Trainer scripts add there)."""
    return sorted([*directory.glob("hpc_ckpt_*.ckpt"), *directory.glob("on_exception.ckpt")])


@dataclasses.dataclass
class OutsideSignal:
    """Send ``signum`` from outside ``delay`` seconds after rank ``rank`` has started training batch
    ``batch`` (``phase="then"``: batch ``batch`` of the one-device run that follows a fit, see
    ``Scenario.then_test_on_one_device``). ``targets``: ``"all"`` (every process of the job, DataLoader
    workers included, as SLURM does), ``"pods"`` (each started process, not its children: what Kubernetes
    signals, the PID 1 of each pod), ``"rank:R"`` (the process of rank R only; independent and slurm modes,
    and rank 0, the launcher's own process, in lightning mode) or ``"node:N"`` (every process of node N, as a
    node drain; jobs across tests/support/nodes.py's nodes). A process that has exited is not signalled."""

    rank: int
    batch: int
    targets: str = "all"
    signum: int = signal.SIGTERM
    delay: float = 0.0
    phase: str = "train"
    sent_at: float | None = None
    reached_at: float | None = None


@dataclasses.dataclass
class JobResult:
    mode: str
    world_size: int
    out: Path
    timed_out: bool
    returncodes: dict[str, int | None]  # process label -> exit code (None if it had to be killed)
    outcomes: dict[int, dict]  # rank -> outcome.rank<R>.json
    logs: dict[str, Path]
    elapsed: float
    outside: list[OutsideSignal] = dataclasses.field(default_factory=list)
    exited_at: dict[str, float] = dataclasses.field(default_factory=dict)  # label -> time.monotonic() seen exited

    def describe(self) -> str:
        lines = [f"mode={self.mode} world_size={self.world_size} timed_out={self.timed_out} "
                 f"elapsed={self.elapsed:.1f}s returncodes={self.returncodes}"]
        for rank, outcome in sorted(self.outcomes.items()):
            lines.append(f"rank {rank}: {json.dumps(outcome, default=str)}")
        for label, path in self.logs.items():
            text = path.read_text(errors="replace") if path.exists() else "<no log>"
            tail = "\n".join(text.splitlines()[-40:])
            lines.append(f"----- tail of {label} ({path}) -----\n{tail}")
        if (self.out / STACKS).exists():
            lines.append(f"----- the stacks of the processes left running ({self.out / STACKS}) -----\n"
                         f"{(self.out / STACKS).read_text(errors='replace')}")
        return "\n".join(lines)

    def log(self, label: str) -> str:
        """The stdout and stderr of one process of the job ("rank1", "launcher", ...)."""
        return self.logs[label].read_text(errors="replace")

    def steps(self) -> dict[int, int]:
        return {rank: o["global_step"] for rank, o in self.outcomes.items()}

    def checkpoints(self) -> list[Path]:
        return stop_checkpoints(self.out)


def run_job(
    out: Path,
    scenario: Scenario | None = None,
    mode: str = "independent",
    world_size: int = 2,
    timeout: float = 120.0,
    outside: OutsideSignal | list[OutsideSignal] | None = None,
    env: dict[str, str] | None = None,
    python: str | None = None,
    script: Path = SCRIPT,
    poll: float = 0.05,
    until_exited: set[str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
) -> JobResult:
    """Run ``scenario`` (default: ``Scenario()``) as one job of ``world_size`` ranks, launched as ``mode`` says,
    to completion or to ``timeout`` seconds; never leaves a process behind. ``env``: environment variables
    added to this one's (the package's settings, SLURM's array ids, ...). ``poll`` is how often the processes
    are looked at (and so the resolution of ``exited_at``). ``until_exited``: labels whose exit ends the job
    (the others, e.g. a stopped rank, are killed). ``rank_env``: rank -> variables of that rank's process alone
    (``independent`` and ``slurm``, where each rank is a node of its own)."""
    python = python or PYTHON
    port = str(free_port())
    scenario = scenario or Scenario()
    if mode in ("slurm", "independent"):  # one process per rank, each a node of its own to the Trainer
        job = Job(scenario, str(out), devices=1, num_nodes=world_size, implementation=IMPLEMENTATION)
    elif mode in ("lightning", "torchrun"):  # one node: the Trainer's launcher or torchrun starts its ranks
        job = Job(scenario, str(out), devices=world_size, implementation=IMPLEMENTATION)
    elif mode == "single":
        job = Job(scenario, str(out), implementation=IMPLEMENTATION)
    else:
        raise ValueError(f"unknown launch mode {mode!r}")
    base = job_environment(job, env)
    commands: dict[str, tuple[list[str], dict[str, str]]] = {}
    if mode == "slurm":  # as srun starts a job step: one task per rank, SLURM_* variables describe it
        for rank in range(world_size):
            commands[f"rank{rank}"] = ([python, str(script)], {
                **base, "MASTER_PORT": port, "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train",
                "SLURM_NTASKS": str(world_size), "SLURM_NNODES": str(world_size), "SLURM_NTASKS_PER_NODE": "1",
                "SLURM_NODELIST": "127.0.0.1", "SLURM_PROCID": str(rank), "SLURM_LOCALID": "0",
                "SLURM_NODEID": str(rank)})
    elif mode == "independent":
        for rank in range(world_size):
            commands[f"rank{rank}"] = ([python, str(script)], {
                **base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world_size),
                "NODE_RANK": str(rank), "LOCAL_RANK": "0"})
    elif mode == "lightning":
        commands["launcher"] = ([python, str(script)], {**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
    elif mode == "torchrun":
        commands["torchrun"] = ([python, "-m", "torch.distributed.run", f"--nproc-per-node={world_size}",
                                 f"--master-port={port}", "--master-addr=127.0.0.1", str(script)], base)
    else:
        commands["single"] = ([python, str(script)], base)
    for rank, variables in (rank_env or {}).items():
        if mode not in ("independent", "slurm"):
            raise ValueError(f"rank_env needs a process per rank (independent, slurm), not {mode!r}")
        commands[f"rank{rank}"][1].update(variables)

    return run_commands(out, mode, world_size, commands, timeout, outside, poll, until_exited)


def run_commands(out: Path, mode: str, world_size: int, commands: dict[str, tuple[list[str], dict[str, str]]],
                 timeout: float, outside: OutsideSignal | list[OutsideSignal] | None = None, poll: float = 0.05,
                 until_exited: set[str] | None = None) -> JobResult:
    """Run a job's ``commands`` (label -> (argv, environment); see :func:`supervise`), sending the ``outside``
    signals when due, and collect what its ranks wrote."""
    signals = [] if outside is None else [outside] if isinstance(outside, OutsideSignal) else list(outside)

    def send_due_signals(procs: dict[str, subprocess.Popen]) -> None:
        for sig in signals:
            if sig.reached_at is None and _reached(out, sig.rank, sig.batch, sig.phase):
                sig.reached_at = time.monotonic()
            if sig.sent_at is None and sig.reached_at is not None and time.monotonic() >= sig.reached_at + sig.delay:
                _send(sig, procs, mode)

    run = supervise(out, commands, timeout, on_poll=send_due_signals, poll=poll, until_exited=until_exited)
    return JobResult(mode, world_size, out, run.timed_out, run.returncodes, read_outcomes(out), run.logs,
                     run.elapsed, signals, run.exited_at)


def read_outcomes(out: Path) -> dict[int, dict]:
    """rank -> what its script wrote in ``out/outcome.rank<R>.json``."""
    outcomes = {}
    for path in out.glob("outcome.rank*.json"):
        data = json.loads(path.read_text())
        outcomes[data["rank"]] = data
    return outcomes


def job_environment(job: Job, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every process of a scenario job starts from (``job.out`` made, and emptied of an earlier
    run's outcomes): this one's, without its launcher variables, with ``env`` and the ``job``."""
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("outcome.rank*.json")) + list(out.glob("progress.rank*")) + list(out.glob(STACKS)):
        stale.unlink()
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {}), **job.environment()}
    for var in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "NODE_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        base.pop(var, None)
    return base


@dataclasses.dataclass
class Supervised:
    """How the processes of one job ended."""

    timed_out: bool
    returncodes: dict[str, int | None]  # label -> exit code (None if it had to be killed)
    logs: dict[str, Path]  # label -> its stdout and stderr
    elapsed: float
    exited_at: dict[str, float]  # label -> time.monotonic() seen exited
    left_behind: list[int]  # with ``linger``: processes of the job still running after it (then killed)

    def output(self) -> str:
        return "".join(path.read_text(errors="replace") for path in self.logs.values() if path.exists())


def supervise(
    out: Path,
    commands: dict[str, tuple[list[str], dict[str, str]]],
    timeout: float,
    on_poll: Callable[[dict[str, subprocess.Popen]], None] | None = None,
    poll: float = 0.05,
    until_exited: set[str] | None = None,
    linger: float = 0.0,
) -> Supervised:
    """Start ``commands`` (label -> (argv, environment)), each in a session of its own with its output
    in ``out/<label>.log``; call ``on_poll`` every ``poll`` seconds until all have exited, the labels in
    ``until_exited`` have, or ``timeout`` seconds passed. ``linger``: once all have exited, wait up to
    that long for the rest of their process groups (ranks a launcher started, which may outlive it by
    a moment) to exit too. Every process of the job, descendants included, is killed in ``finally``."""
    procs: dict[str, subprocess.Popen] = {}
    groups: dict[int, int | None] = {}  # every process group seen in the job's trees -> its leader's start time
    logs: dict[str, Path] = {}
    timed_out = False
    exited_at: dict[str, float] = {}
    left_behind: list[int] = []
    started = time.monotonic()
    try:
        for label, (cmd, proc_env) in commands.items():
            logs[label] = out / f"{label}.log"
            with open(logs[label], "w") as log:
                procs[label] = subprocess.Popen(cmd, env=proc_env, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=out)
            groups[procs[label].pid] = _start_time(procs[label].pid)  # not reaped yet: still its own pid
        deadline = started + timeout
        next_scan = 0.0
        while [p.poll() for p in procs.values()].count(None):  # poll every process, every time
            for label, proc in procs.items():
                if label not in exited_at and proc.returncode is not None:
                    exited_at[label] = time.monotonic()
            if until_exited and until_exited <= set(exited_at):
                break
            if time.monotonic() > next_scan:
                _add_groups(groups, procs)
                next_scan = time.monotonic() + 0.5
            if time.monotonic() > deadline:
                timed_out = True
                break
            if on_poll is not None:
                on_poll(procs)
            time.sleep(poll)
        for label, proc in procs.items():
            if proc.returncode is not None:
                exited_at.setdefault(label, time.monotonic())
        lingering_until = time.monotonic() + linger
        while not timed_out and len(exited_at) == len(procs) and _alive_in(_ours(groups)) and \
                time.monotonic() < lingering_until:
            time.sleep(poll)
        left_behind = _alive_in(_ours(groups)) if linger else []
    finally:
        _add_groups(groups, procs)
        if timed_out:
            dump_stacks(out / STACKS, _running_trees(procs))
        for pid in _running_trees(procs):
            signal_pid(pid, signal.SIGKILL)
        for pgid in _ours(groups):
            _kill_group(pgid)
        for proc in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):  # a process that survives SIGKILL: reported below
                proc.wait(timeout=30)
    returncodes = {label: (None if label not in exited_at and _killed(p) else p.returncode)
                   for label, p in procs.items()}
    return Supervised(timed_out, returncodes, logs, time.monotonic() - started, exited_at, left_behind)


def stub_scontrol(directory: Path, fail: str | None = None) -> dict[str, str]:
    """Environment that puts a stand-in ``scontrol`` on PATH: it appends its arguments to a file
    (read them with :func:`scontrol_calls`) and, with ``fail``, exits 1 with that reason. ``scontrol
    show job`` describes a running requeueable job that is not being preempted. (tests/test_slurm.py runs the real
    one.)"""
    stub = directory / "bin" / "scontrol"
    stub.parent.mkdir(parents=True, exist_ok=True)
    stub.write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_CALLS"\n'
                    'if [ -n "$SCONTROL_FAIL" ]; then echo "slurm_requeue error: $SCONTROL_FAIL" >&2; exit 1; fi\n'
                    'if [ "$1" = show ]; then echo "JobId=$4 JobName=train JobState=RUNNING Requeue=1 Restarts=0 '
                    'StartTime=2026-12-01T09:00:00 PreemptTime=None"; fi\n')
    stub.chmod(0o755)
    env = {"PATH": f"{stub.parent}:{os.environ['PATH']}", "SCONTROL_CALLS": str(directory / "scontrol.calls")}
    return {**env, "SCONTROL_FAIL": fail} if fail else env


def scontrol_calls(env: dict[str, str]) -> list[str]:
    """The argument lines the stub ``scontrol`` of ``env`` recorded, one per call."""
    calls = Path(env["SCONTROL_CALLS"])
    return calls.read_text().splitlines() if calls.exists() else []

@contextlib.contextmanager
def once_reached(out: Path, rank: int, batch: int, action: Callable[[], None]) -> Iterator[threading.Event]:
    """Run ``action`` once rank ``rank`` of the job writing into ``out`` has started training batch ``batch``: what
    the world outside the job does at that point (a metadata service starts serving a notice), from a thread of
    the test's that leaving stops and joins. Yields an event set once ``action`` has run."""
    done, leaving = threading.Event(), threading.Event()

    def watch() -> None:
        while not leaving.wait(0.05):
            if _reached(out, rank, batch):
                action()
                done.set()
                return

    thread = threading.Thread(target=watch, name=f"once-rank{rank}-reached-batch{batch}", daemon=True)
    thread.start()
    try:
        yield done
    finally:
        leaving.set()
        thread.join(timeout=10)


def _reached(out: Path, rank: int, batch: int, phase: str = "train") -> bool:
    path = out / f"progress.rank{rank}"
    return path.exists() and f"{phase} {batch} " in path.read_text()


def _send(outside: OutsideSignal, procs: dict[str, subprocess.Popen], mode: str) -> None:
    outside.sent_at = time.monotonic()
    if outside.targets == "all":  # like SLURM: every process of the job step, DataLoader workers included
        _signal_trees(procs.values(), outside.signum)
    elif outside.targets == "pods":
        for proc in procs.values():
            _signal_running(proc, outside.signum)
    elif outside.targets.startswith("node:"):  # a node drain: every process of the node (tests/support/nodes.py labels)
        node = f"node{outside.targets.split(':')[1]}"
        _signal_trees([proc for label, proc in procs.items() if label.split(".")[0] == node], outside.signum)
    elif outside.targets == "rank:0" and mode == "lightning":  # the launcher's own process is rank 0
        _signal_running(procs["launcher"], outside.signum)
    elif outside.targets.startswith("rank:"):
        if mode not in ("independent", "slurm"):
            raise ValueError("targets='rank:R' needs one process per rank (independent or slurm mode)")
        _signal_running(procs[f"rank{outside.targets.split(':')[1]}"], outside.signum)
    else:
        raise ValueError(f"unknown targets {outside.targets!r}")


def _signal_trees(procs: Iterable[subprocess.Popen], signum: int) -> None:
    """Send ``signum`` to each of ``procs`` that still runs and to all its descendants."""
    for proc in procs:
        for pid in _tree(proc.pid) if proc.poll() is None else ():
            signal_pid(pid, signum)


def _signal_running(proc: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` to ``proc`` if it has not exited (once reaped, its pid may be another process's)."""
    if proc.poll() is None:
        signal_pid(proc.pid, signum)


def _process_table(with_zombies: bool = True) -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group), read from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if with_zombies or fields[0] not in ("Z", "X"):
                table[int(entry.name)] = (int(fields[1]), int(fields[2]))
    return table


def _alive_in(groups: set[int]) -> list[int]:
    """Processes (not zombies) in any of ``groups``."""
    return [pid for pid, (_, pgid) in _process_table(with_zombies=False).items() if pgid in groups]


STACKS = "stacks.txt"  # where a job that timed out leaves the stacks of its processes
PY_SPY = Path(sys.executable).parent / "py-spy"  # requirements/test.txt


GDB = shutil.which("gdb")  # .ci/run installs it


def dump_stacks(path: Path, pids: list[int], seconds: float = 60.0) -> None:
    """Write the Python stacks, every thread's, of ``pids`` still running (not zombies) to ``path``, for a job
    that did not finish: a hang seen once in CI is then a hang that names where it waits. py-spy reads them
    from outside, so the job's processes run nothing of it; where it finds no Python to read (a child stuck
    in CPython's own code after fork), gdb writes the native stack. All of them within ``seconds``."""
    alive = set(_process_table(with_zombies=False))
    until = time.monotonic() + seconds
    with open(path, "w") as stacks:
        for pid in pids:
            if pid not in alive:
                continue
            failed = _write_stack(stacks, pid, [str(PY_SPY), "dump", "--pid", str(pid)], until) not in (0, None)
            if failed and GDB is not None:
                _write_stack(stacks, pid, [GDB, "-p", str(pid), "-batch", "-ex", "thread apply all bt 30"], until)


def _write_stack(stacks: TextIO, pid: int, command: list[str], until: float) -> int | None:
    """Run ``command``, a tool that prints ``pid``'s stacks, within the time left before ``until`` (20 s at most),
    and write what it printed, or why it printed nothing, to ``stacks``. Returns its exit code (None: it did not
    run to its end)."""
    left = until - time.monotonic()
    try:
        if left <= 0:
            raise subprocess.TimeoutExpired(command, 0)
        dumped = subprocess.run(command, capture_output=True, text=True, timeout=min(20.0, left))
    except (OSError, subprocess.TimeoutExpired) as error:
        stacks.write(f"===== pid {pid}: no stack ({type(error).__name__}: {error}) =====\n")
        return None
    stacks.write(f"===== pid {pid}: {Path(command[0]).name} =====\n{dumped.stdout}{dumped.stderr}\n")
    return dumped.returncode


def _tree(root: int) -> list[int]:
    """``root`` and all its descendants: ranks, DataLoader workers, torchrun's workers (which run in
    sessions of their own, so a process group does not reach them)."""
    table = _process_table()
    found, frontier = [root], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in table.items() if ppid == parent]
        found += children
        frontier += children
    return found


def signal_pid(pid: int, signum: int) -> None:
    """Send ``signum`` to ``pid`` if it still runs (it may have exited on its own)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _running_trees(procs: dict[str, subprocess.Popen]) -> list[int]:
    """The started processes still running and their descendants. Not the tree of one that has exited: once
    reaped, its pid is free, and a process another test starts may get it (pid_max is 32768 here, and every
    thread takes a number too, so numbers come round again within a make test)."""
    return [pid for proc in procs.values() if proc.poll() is None for pid in _tree(proc.pid)]


def _add_groups(groups: dict[int, int | None], procs: dict[str, subprocess.Popen]) -> None:
    """Add the process groups led by the started processes still running or by their descendants, each with
    its leader's start time, to ``groups``."""
    for pid in _running_trees(procs):
        if pid not in groups and _pgid(pid) == pid:
            groups[pid] = _start_time(pid)


def _ours(groups: dict[int, int | None]) -> set[int]:
    """The groups of ``groups`` still the job's: not one whose number now leads a process started at another
    time (the job's group ended, and another test's process took the number). A group whose leader has exited
    while members remain keeps its number until the last of them is gone."""
    return {pgid for pgid, started in groups.items() if _start_time(pgid) in (None, started)}


def _start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (/proc/<pid>/stat's 22nd field); None if no such process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _killed(proc: subprocess.Popen) -> bool:
    return proc.returncode == -signal.SIGKILL


