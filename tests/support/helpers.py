"""What the tests assert, shared: the bounds, the checks of a job's outcome, and how a scenario job is run.

The job runner itself is ``harness.py``; what a job trains is a ``scenario.Scenario``, and the faults it sends
itself are ``injection.py``. Test modules,
the soak and the SLURM tests import from here, never from one another.
"""

from __future__ import annotations

import csv
import re
import signal
from collections.abc import Callable
from pathlib import Path

import torch
from ddp_sigterm_tests.harness import (
    EXPECT_LIGHTNING,
    IMPLEMENTATION,
    JobResult,
    free_port,
    run_job,
    signal_pid,
    stop_checkpoints,
)
from ddp_sigterm_tests.scenario import Scenario

# What must finish gets a generous bound (2 busy cores); what must not hang has its own, short one.
MUST_FINISH = 180.0
HANG_BOUND = 30.0
SIGTERM_EXIT = 128 + signal.SIGTERM
# IMPLEMENTATION (from harness.py): which fix the jobs run, "package" (ddp_sigterm installed, the default) or "patched"
# (a Lightning built from patches/, without ddp_sigterm). Only the package records its decision
# (``SIGTERMException.stop``).
assert IMPLEMENTATION in ("package", "patched"), IMPLEMENTATION
STEP_SLEEP = Scenario().step_sleep  # seconds of work per step in the scenario script
MAX_DELAY = 1.0  # the default setting
VAL_BATCHES = Scenario().val_batches  # evaluation batches per rank in the scenario script


def assert_unison_stop(result: JobResult, *, exit_code: int = SIGTERM_EXIT, checkpoint: bool = True,
                       same_boundary: bool = True) -> int:
    """Every rank raised SIGTERMException at the same step and exited 128+signal; returns the step.
    ``same_boundary=False`` where ranks legitimately passed different numbers of check points
    (loops of uneven length)."""
    why = result.describe()
    assert not result.timed_out, f"job did not finish within {MUST_FINISH}s (deadlock?)\n{why}"
    assert sorted(result.outcomes) == list(range(result.world_size)), f"missing rank outcomes\n{why}"
    for rank, outcome in result.outcomes.items():
        assert outcome["exception"] == "SIGTERMException", f"rank {rank} did not stop cleanly\n{why}"
        if EXPECT_LIGHTNING and "lightning" in outcome:
            assert outcome["lightning"] == EXPECT_LIGHTNING, f"rank {rank} ran the wrong Lightning\n{why}"
        assert outcome["exit_code"] == exit_code, f"rank {rank} exit code\n{why}"
        if IMPLEMENTATION == "package":  # the package's decision record proves the package stopped it
            assert outcome["stop"] is not None, f"rank {rank} stopped without the package\n{why}"
        else:
            assert "UnisonStop" not in outcome["callbacks"], f"rank {rank} ran the package, not the patch\n{why}"
    steps = set(result.steps().values())
    assert len(steps) == 1, f"ranks stopped at different steps {result.steps()}\n{why}"
    started = {o["batches_started"] for o in result.outcomes.values()}
    assert len(started) == 1, f"a rank started a batch another did not start\n{why}"
    if IMPLEMENTATION == "package":
        decisions = {(o["stop"]["signum"], o["stop"]["boundary"] if same_boundary else None)
                     for o in result.outcomes.values()}
        assert len(decisions) == 1, f"ranks disagree on the decision\n{why}"
    if result.mode in ("independent", "slurm", "single"):
        assert set(result.returncodes.values()) == {exit_code}, f"process exit codes\n{why}"
    elif result.mode == "lightning":
        assert result.returncodes["launcher"] == exit_code, f"launcher exit code\n{why}"
    else:
        assert result.returncodes["torchrun"] != 0, f"torchrun reported success\n{why}"
    (step,) = steps
    ckpts = result.checkpoints()
    if checkpoint:
        assert len(ckpts) == 1, f"expected one hpc checkpoint, found {ckpts}\n{why}"
        # a sharded checkpoint (FSDP2's) is a folder: what is not tensors is its meta.pt
        saved = torch.load(ckpts[0] / "meta.pt" if ckpts[0].is_dir() else ckpts[0], map_location="cpu",
                           weights_only=False)
        assert saved["global_step"] == step, f"checkpoint holds step {saved['global_step']}, ranks stopped at {step}"
    else:
        assert ckpts == [], f"no checkpoint expected outside fit, found {ckpts}"
    return step


def assert_stopped_after(step: int, signalled: int, step_seconds: float = STEP_SLEEP) -> None:
    """Stopped at or after the signalled step, and no later than the delay bound allows: the ranks agree on
    the heartbeat, every max_delay/2 s, then up to one step (up to max_delay / step time steps, and one)."""
    assert signalled <= step <= signalled + int(MAX_DELAY / step_seconds) + 1, (step, signalled)


def assert_latency(result: JobResult, signalled_at: float | None = None) -> None:
    """Signal to agreed stop within max(one step, max_delay), plus scheduling slack on 2 busy cores.
    Without the package's decision record, the time the exception reached the script bounds it from above."""
    for rank, outcome in result.outcomes.items():
        sent = signalled_at if signalled_at is not None else outcome["injected_at"]
        if sent is None:
            continue
        if outcome["stop"] is not None:
            latency = outcome["stop"]["decided_at"] - sent
            after = f"{outcome['stop']['boundaries_since_signal']} step boundaries after the signal was recorded"
        else:
            latency, after = outcome["ended_at"] - sent, "checkpoint save included"
        print(f"stop latency rank {rank}: {latency * 1000:.0f} ms, {after}")
        assert latency < max(STEP_SLEEP, MAX_DELAY) + 2.0, result.describe()


def assert_finished(result: JobResult, steps: int, stock: bool = False) -> None:
    """Every rank trained ``steps`` steps and exited 0. ``stock``: a run without the package, which
    may abort at exit with gloo's "terminate called without an active exception" (-6), the failure
    the package's ``destroy_at_exit`` removes; every rank must still have finished."""
    why = result.describe()
    assert not result.timed_out, why
    codes = set(result.returncodes.values())
    if stock and -signal.SIGABRT in codes:
        aborted = [label for label, code in result.returncodes.items() if code == -signal.SIGABRT]
        assert all("terminate called" in result.log(label) for label in aborted), why
        print(f"stock Lightning aborted at exit (gloo, -6) in {aborted}")
        codes.discard(-signal.SIGABRT)
    assert codes <= {0} if stock else codes == {0}, why
    assert {o["exception"] for o in result.outcomes.values()} == {None}, why
    assert set(result.steps().values()) == {steps}, why


def assert_signalled_yet_finished(result: JobResult, steps: int) -> None:
    """Rank 1 was signalled, and every rank still finished (the patched Lightning, where the fix lets finished work or
    prediction end as it does with one device)."""
    assert result.outcomes.get(1, {}).get("injected_at") is not None, result.describe()
    assert_finished(result, steps=steps)


def fit(tmp: Path, scenario: Scenario | None = None, *, mode: str = "independent", world_size: int = 2,
        env: dict[str, str] | None = None, rank_env: dict[int, dict[str, str]] | None = None) -> JobResult:
    """A scenario job (support/scenario_train.py) that must finish within MUST_FINISH seconds; ``env``: environment
    variables of its processes (the package's settings); ``rank_env``: of one rank's (see :func:`run_job`)."""
    return run_job(tmp, scenario, mode=mode, world_size=world_size, timeout=MUST_FINISH, env=env, rank_env=rank_env)


def torchrun_restarts(max_restarts: int = 3) -> dict[str, str]:
    """The environment of ``torchrun --max-restarts=N`` with the workaround of docs/torchrun.md: the c10d
    rendezvous, and a store of its own for each attempt (torchrun reads ``PET_<FLAG>`` for a flag not given)."""
    return {"PET_MAX_RESTARTS": str(max_restarts), "PET_RDZV_BACKEND": "c10d",
            "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


# -- the examples' output ("[rank R] ..." lines) ---------------------------------------------------

class SignalAfterStep:
    """An ``on_poll`` for :func:`harness.supervise`: once the examples' output (``text()``) shows that rank
    ``rank`` has done step ``step``, send ``signum`` to that rank's process (its ``[rank R] pid P`` line),
    once; ``sent`` holds the pid it signalled."""

    def __init__(self, text: Callable[[], str], rank: int, step: int, signum: int = signal.SIGTERM) -> None:
        self.text, self.rank, self.step, self.signum = text, rank, step, signum
        self.sent: list[int] = []

    def __call__(self, procs: object) -> None:
        if self.sent:
            return
        text = self.text()
        pid = re.search(rf"\[rank {self.rank}\] pid (\d+),", text)
        if pid and re.search(rf"\[rank {self.rank}\] step {self.step}(?!\d)", text):
            signal_pid(int(pid.group(1)), self.signum)
            self.sent.append(int(pid.group(1)))


def per_rank(pattern: str, text: str) -> dict[int, int]:
    """rank -> the number in the first line matching ``[rank R] <pattern>`` (pattern has one group)."""
    found: dict[int, int] = {}
    for rank, number in re.findall(rf"\[rank (\d+)\] {pattern}", text):
        found.setdefault(int(rank), int(number))
    return found


def steps_done(text: str) -> dict[int, list[int]]:
    done: dict[int, list[int]] = {}
    for rank, step in re.findall(r"\[rank (\d+)\] step (\d+)", text):
        done.setdefault(int(rank), []).append(int(step))
    return done


def saved_step(example: str, root: Path) -> tuple[list[Path], int]:
    """The checkpoints the stop left, and the step the one checkpoint holds."""
    if example == "trainer":
        files = stop_checkpoints(root)
        key = "global_step"
    else:
        files = sorted(p for p in root.iterdir() if re.fullmatch(r"step-\d+\.(pt|ckpt)", p.name))
        key = "step"
    assert len(files) == 1, f"expected one checkpoint in {root}, found {files}"
    return files, torch.load(files[0], map_location="cpu", weights_only=False)[key]


def assert_trainer_example_went_on(root: Path, output: str, max_steps: int, why: str) -> list[int]:
    """The resume of examples/trainer.py (with the package, checkpoints in ``root``, ``output`` its ranks' output):
    its StatefulDataLoader got its position back, and its CSVLogger appended to the stop's log: one version, one
    ``metrics.csv``, steps in order to the last. Returns those steps."""
    assert "the training loaders resume where the stop left them" in output, why
    assert "the loggers continue the stop's runs: CSVLogger version 0" in output, why
    logs = root / "lightning_logs"
    assert sorted(path.name for path in logs.iterdir()) == ["version_0"], why
    with open(logs / "version_0" / "metrics.csv", newline="") as file:
        steps = [int(row["step"]) for row in csv.DictReader(file)]
    assert steps == sorted(set(steps)), f"steps {steps}\n{why}"
    assert steps[-1] == max_steps - 1, f"steps {steps}\n{why}"
    return steps
