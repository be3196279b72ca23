"""A Kubernetes-style supervisor, without a cluster: each rank is a "pod" (a process in a session of its
own, started with the same command and its rank in the environment, as a JobSet or a PyTorchJob starts
one pod per rank), a node drain SIGTERMs every pod's main process at once (the container's PID 1, as
the kubelet does, not its DataLoader workers), SIGKILLs whatever is left after the grace period
(``terminationGracePeriodSeconds``), and the Job controller starts the same command again. With
``DDP_SIGTERM_RESUME=1`` in the pod template, the relaunch resumes by itself.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

import pytest
from ddp_sigterm_tests.harness import OutsideSignal, run_job
from ddp_sigterm_tests.helpers import MUST_FINISH, SIGTERM_EXIT, assert_finished
from ddp_sigterm_tests.scenario import Scenario

pytestmark = pytest.mark.scenario
GRACE = 30.0  # Kubernetes' default terminationGracePeriodSeconds
POD_TEMPLATE = {"DDP_SIGTERM_RESUME": "1"}  # the pods' environment
TRAINING = Scenario(data_by_step=True, batches=4, max_steps=10)


def drain(grace: float, batch: int = 3) -> list[OutsideSignal]:
    """SIGTERM to every pod once rank 0 starts ``batch``; SIGKILL to every process left ``grace`` seconds later."""
    return [OutsideSignal(rank=0, batch=batch, targets="pods"),
            OutsideSignal(rank=0, batch=batch, targets="all", signum=signal.SIGKILL, delay=grace)]


def pods(out: Path, signals: list[OutsideSignal] | None = None, training: Scenario = TRAINING):
    return run_job(out, training, mode="independent", timeout=MUST_FINISH, outside=signals, env=POD_TEMPLATE)


def test_node_drain_stops_every_pod_in_the_grace_period_and_the_relaunch_resumes(tmp_path: Path) -> None:
    signals = drain(GRACE)
    drained = pods(tmp_path / "job", signals)
    why = drained.describe()
    term, kill = signals
    assert not drained.timed_out, why
    assert term.sent_at is not None, why
    assert set(drained.returncodes.values()) == {SIGTERM_EXIT}, why  # every pod ended by itself: 143
    needed = max(drained.exited_at.values()) - term.sent_at
    print(f"every pod exited {needed:.2f} s after the drain's SIGTERM (grace period {GRACE:.0f} s)")
    assert needed < GRACE, why
    assert kill.sent_at is None, why
    (step,) = set(drained.steps().values())
    assert [p.name for p in drained.checkpoints()] == ["hpc_ckpt_1.ckpt"], why
    relaunched = pods(tmp_path / "job")  # the same command: no ckpt_path, DDP_SIGTERM_RESUME=1
    assert_finished(relaunched, steps=10)
    assert {o["batches_started"] for o in relaunched.outcomes.values()} == {10 - step}, relaunched.describe()
    straight = pods(tmp_path / "straight")
    assert_finished(straight, steps=10)
    weights = {o["weights"] for result in (relaunched, straight) for o in result.outcomes.values()}
    assert len(weights) == 1, "the relaunched job ended with other weights than an uninterrupted one"


@pytest.mark.extended
@pytest.mark.parametrize("strategy", ["", "fsdp2"])
def test_a_grace_period_shorter_than_the_save_loses_only_this_stop(tmp_path: Path, strategy: str) -> None:
    """The kubelet's SIGKILL comes while the stop checkpoint is being written (a 64 MiB checkpoint, a
    grace period of 0.1 s; DDP's one file, or FSDP2's folder of shards): nothing is named a checkpoint, and the
    relaunch starts afresh and finishes."""
    signals = drain(0.1)
    big = replace(TRAINING, payload_mb=64, strategy=strategy)
    killed = pods(tmp_path / "job", signals, big)
    why = killed.describe()
    assert not killed.timed_out, why
    assert signals[1].sent_at is not None, why
    assert set(killed.returncodes.values()) == {-signal.SIGKILL}, why
    assert killed.checkpoints() == [], why
    relaunched = pods(tmp_path / "job", training=big)
    assert_finished(relaunched, steps=10)
    assert {o["batches_started"] for o in relaunched.outcomes.values()} == {10}, relaunched.describe()


@pytest.mark.extended
def test_node_drain_of_a_torchrun_pod(tmp_path: Path) -> None:
    """One pod whose PID 1 is torchrun (``exec torchrun ...``): the kubelet's SIGTERM reaches torchrun only;
    torchrun forwards it to its workers (and SIGKILLs them 30 s later, its own window), the workers stop in
    unison with exit 143 and the checkpoint, and torchrun itself exits 1 (its SignalException): a pod's
    exit code cannot say "retry me" here; a drain is recognised by its pod condition (docs/kubernetes.md)."""
    term = OutsideSignal(rank=0, batch=3, targets="pods")
    drained = run_job(tmp_path, TRAINING, mode="torchrun", timeout=MUST_FINISH, outside=[term], env=POD_TEMPLATE)
    why = drained.describe()
    assert not drained.timed_out, why
    assert drained.returncodes == {"torchrun": 1}, why
    assert "got signal: 15" in drained.log("torchrun"), why
    assert {o["exit_code"] for o in drained.outcomes.values()} == {SIGTERM_EXIT}, why
    assert len(set(drained.steps().values())) == 1, why
    assert len(drained.checkpoints()) == 1, why
    needed = drained.exited_at["torchrun"] - term.sent_at
    print(f"the torchrun pod exited {needed:.2f} s after its SIGTERM")
    assert needed < GRACE, why
