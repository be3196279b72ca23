"""The multi-process regression suite: real training jobs, real signals, outcomes a user sees.

Every test starts a real job through the harness (gloo on CPU, OMP_NUM_THREADS=1), each process in
its own process group, under a hard timeout, and kills everything in ``finally``. On failure the
assertion message carries each rank's outcome and the tail of every log.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ddp_sigterm_tests.harness import JobResult, OutsideSignal, run_job
from ddp_sigterm_tests.helpers import (
    HANG_BOUND,
    IMPLEMENTATION,
    MAX_DELAY,
    MUST_FINISH,
    SIGTERM_EXIT,
    VAL_BATCHES,
    assert_finished,
    assert_latency,
    assert_signalled_yet_finished,
    assert_stopped_after,
    assert_unison_stop,
    fit,
)
from ddp_sigterm_tests.scenario import Scenario

pytestmark = pytest.mark.scenario
# Marks the scenarios that hold for the patched Lightning too (``make test-patched``): all but those
# about the package itself (its opt-out).
patched = pytest.mark.patched


# -- the regression test from the original proposal ---------------------------------------------
@patched
def test_seed_sigterm_rank0_batch2_stops_every_rank_and_resumes(tmp_path: Path) -> None:
    result = fit(tmp_path, Scenario(inject="0:2:forward"))
    step = assert_unison_stop(result)
    assert_stopped_after(step, 2)
    assert_latency(result)
    resumed = fit(tmp_path, Scenario(resume=True))
    assert_finished(resumed, steps=12)
    assert {o["batches_started"] for o in resumed.outcomes.values()} == {12 - step}, resumed.describe()


# -- whichever rank, whichever phase, however launched -------------------------------------------
@patched
def test_nonzero_rank_signalled_after_optimizer_step(tmp_path: Path) -> None:
    """Rank 1 signalled after its optimizer step. With the package, what an operator greps for after a preemption, on
    every rank: the signal, the rank that received it and when, the agreed step, the checkpoint and its save time."""
    result = fit(tmp_path, Scenario(inject="1:2:optimizer"))
    step = assert_unison_stop(result)
    assert_stopped_after(step, 2)
    assert_latency(result)
    if IMPLEMENTATION == "package":
        assert_every_rank_logs_the_stop(result, step)


def assert_every_rank_logs_the_stop(result: JobResult, step: int) -> None:
    logs = {rank: result.log(f"rank{rank}") for rank in (0, 1)}
    why = result.describe()
    signalled = (rf"ddp_sigterm INFO rank 1 of 2: SIGTERM received here at \d{{4}}-\d\d-\d\d [0-9:.]+ \([0-9.]+ s"
                 rf"(, \d+ step boundaries)? before the agreement\); every rank stops at step {step} ")
    assert re.search(signalled, logs[1]), why
    assert (f"ddp_sigterm INFO rank 0 of 2: SIGTERM received by rank 1, not here; every rank stops at step {step} "
            in logs[0]), why
    (path,) = result.checkpoints()
    for rank, log in logs.items():
        assert re.search(rf"rank {rank} of 2: the stop checkpoint of step {step} is saved: {re.escape(str(path))} "
                         r"\([0-9.]+ s, every rank\)", log), why


# Each launcher once, with the other rank signalled (the seed test: independent ranks, rank 0); which rank is signalled
# changes nothing in the decision (the simulation in tests/unit/core/test_decision.py signals any). Lightning's launcher
# with rank 1 signalled is the Trainer example's stop in make test (test_examples.py), and here in make test-extended.
@patched
@pytest.mark.parametrize(("mode", "rank"), [pytest.param("lightning", 1, marks=pytest.mark.extended), ("torchrun", 0)])
def test_launchers(tmp_path: Path, mode: str, rank: int) -> None:
    result = fit(tmp_path, Scenario(inject=f"{rank}:2:batch_start"), mode=mode)
    assert_stopped_after(assert_unison_stop(result), 2)
    assert_latency(result)


@pytest.mark.parametrize("strategy", ["ddp_spawn", pytest.param("ddp_notebook", marks=pytest.mark.extended)])
def test_ddp_spawn_launching_process_exits_like_its_ranks(tmp_path: Path, strategy: str) -> None:
    """strategy="ddp_spawn" (and "ddp_notebook", forked), SIGTERM to rank 1 (a spawned process): the ranks
    stop at the same step and save it, and the launching process (not a rank) exits 143 with no traceback
    (it was 1, with torch's ProcessExitedException)."""
    result = fit(tmp_path, Scenario(inject="1:2:batch_start", strategy=strategy), mode="lightning")
    _assert_spawned_stop_exits_143(result)


@pytest.mark.extended  # 2 jobs of ~16 s (the abort's cause is found: see the crash test below)
@pytest.mark.parametrize("run", range(2))
def test_ddp_spawn_stop_exits_143_every_time(tmp_path: Path, run: int) -> None:
    """Issue 36, finding 8: a spawned rank aborted now and then at its exit after the stop ("terminate called
    without an active exception", 1 run in 10), and the launching process exited 1 with torch's traceback: its
    coordinator was never closed (a spawned rank runs fit without Lightning's exception handling), and the heartbeat
    still beat while the interpreter finalized. The same stop, twice more (one test each: make test-extended's workers
    share them)."""
    result = fit(tmp_path, Scenario(inject="1:2:batch_start", strategy="ddp_spawn"), mode="lightning")
    _assert_spawned_stop_exits_143(result)


@pytest.mark.extended  # 3 jobs of ~15 s
@pytest.mark.parametrize("run", range(3))
def test_ddp_spawn_crash_ends_the_heartbeat_before_the_exit(tmp_path: Path, run: int) -> None:
    """Every spawned rank raises at step 3, no signal: each leaves through torch's ``sys.exit(1)`` with its
    coordinator open (``fit`` runs there without Lightning's exception handling, so nothing closes it). The runtime's
    exit function ends the heartbeat before the interpreter finalizes, and the port keeps the last beat's work, so
    gloo's worker thread never frees it during finalization (where taking the GIL ends that thread in
    ``pthread_exit`` and aborts the rank: "terminate called without an active exception"; 4 runs in 50 when the
    last beat's work was let go with the heartbeat's thread)."""
    crash = Scenario(strategy="ddp_spawn", raise_at_step=3)
    result = fit(tmp_path, crash, mode="lightning", env={"DDP_SIGTERM_MAX_DELAY": "0.02"})
    why = result.describe()
    assert not result.timed_out, why
    assert result.returncodes == {"launcher": 1}, why
    log = result.log("launcher")
    assert "crashes at step 3 (raise_at_step)" in log, why
    assert "terminate called" not in log, why
    assert "terminated with signal" not in log, why  # torch's report of a rank killed by a signal (SIGABRT)


def _assert_spawned_stop_exits_143(result: JobResult) -> None:
    why = result.describe()
    assert not result.timed_out, why
    assert result.returncodes == {"launcher": SIGTERM_EXIT}, why
    log = result.log("launcher")
    assert "Traceback" not in log, why
    assert "terminate called" not in log, why
    (checkpoint,) = result.checkpoints()
    step = torch.load(checkpoint, weights_only=False)["global_step"]
    assert_stopped_after(step, 2)
    assert f"every rank stops at step {step}" in log, why


@patched
def test_three_ranks_signalled_at_different_batches_last_rank_in_backward(tmp_path: Path) -> None:
    result = fit(tmp_path, Scenario(inject="2:2:backward;0:4:forward"), world_size=3)
    assert_stopped_after(assert_unison_stop(result), 2)


@patched
@pytest.mark.parametrize("mode", ["independent", pytest.param("lightning", marks=pytest.mark.extended), "torchrun"])
def test_every_process_signalled_with_dataloader_workers(tmp_path: Path, mode: str) -> None:
    """As SLURM does: every process of the job, DataLoader workers included, gets SIGTERM. The package blocks it in
    the workers it sees forked; with the pull requests, the workers leave it to the Trainer (PR 6)."""
    outside = OutsideSignal(rank=1, batch=3, targets="all")
    result = run_job(tmp_path, Scenario(num_workers=2, max_steps=60, batches=30), mode=mode, world_size=2,
                     timeout=MUST_FINISH, outside=outside)
    assert outside.sent_at is not None, result.describe()
    assert "killed by signal" not in "".join(p.read_text() for p in result.logs.values()), result.describe()
    assert_unison_stop(result)
    assert_latency(result, signalled_at=outside.sent_at)


@pytest.mark.versions
@pytest.mark.parametrize(("package", "rank"), [("lightning.pytorch", 0), ("pytorch_lightning", 1)])
def test_release_stops_in_unison_and_resumes(tmp_path: Path, package: str, rank: int) -> None:
    """Each release of make test-versions, both distributions: rank 0 signalled at batch 2 under one, rank 1 under
    the other (the two distributions share the release's code, so each release sees both: Lightning's per-batch
    broadcast from rank 0 makes them differ), every rank stops at the same step with one checkpoint, and the next
    run resumes from it and finishes."""
    trainer = Scenario(trainer_package=package)
    result = fit(tmp_path, replace(trainer, inject=f"{rank}:2:forward"))
    assert {o["trainer_package"] for o in result.outcomes.values()} == {package}, result.describe()
    step = assert_unison_stop(result)
    assert_stopped_after(step, 2)
    resumed = fit(tmp_path, replace(trainer, resume=True))
    assert_finished(resumed, steps=12)
    assert {o["batches_started"] for o in resumed.outcomes.values()} == {12 - step}, resumed.describe()


@patched
@pytest.mark.extended  # make test's 6 minutes: its other jobs assert the latency of their stop
def test_stop_latency_late_in_a_run_of_short_steps(tmp_path: Path) -> None:
    """A signal late in a run of short steps stops within max_delay."""
    result = fit(tmp_path, Scenario(inject="1:250:forward", step_sleep=0.001, max_steps=900, batches=900))
    step = assert_unison_stop(result)
    assert 250 <= step < 900  # steps take ~3 ms: max_delay allows ~300 more, the end of training is further
    assert_latency(result)


@pytest.mark.extended  # make test: test_stop_latency_late_in_a_run_of_short_steps
def test_stop_bound_holds_when_steps_become_slower(tmp_path: Path) -> None:
    """600 steps of ~1 ms, then every step sleeps 100 times as long (0.1 s). Rank 1 is signalled at batch 605, in
    the slow phase: every rank stops within max(2 steps, max_delay) of the signal, however short the steps before
    it were."""
    change, slow, signalled = 601, 0.1, 605
    result = fit(tmp_path, Scenario(inject=f"1:{signalled}:forward", step_sleep=0.001, slow_phase=(change, slow),
                                    max_steps=660, batches=660))
    step = assert_unison_stop(result)
    latest = signalled + max(2, math.ceil(MAX_DELAY / slow))
    assert signalled <= step <= latest, f"stopped at step {step}, signalled in batch {signalled}, bound {latest}\n" \
                                        f"{result.describe()}"
    assert_latency(result)


@patched
@pytest.mark.extended  # make test-patched runs it too (-m patched)
def test_fast_validation_does_not_stretch_the_wait_in_slow_training(tmp_path: Path) -> None:
    """Validation batches take ~1 ms, training steps 200 ms: a signal in the first training step after validation
    stops within max_delay's worth of slow steps; how fast validation ran does not lengthen the wait."""
    step_sleep = 0.2
    result = fit(tmp_path, Scenario(inject="1:13:forward", step_sleep=step_sleep, val_sleep=0, batches=24,
                                    max_steps=24, val_every=12, val_batches=40))
    assert_stopped_after(assert_unison_stop(result), 13, step_seconds=step_sleep)


# -- validation, trainer.validate, end of training ----------------------------------------------
@patched
def test_signal_during_validation_inside_fit_then_resume(tmp_path: Path) -> None:
    """With persistent DataLoader workers (found by the soak: stopped inside validation, they are still alive at exit,
    where multiprocessing ends them with SIGTERM and waits; workers that block SIGTERM must still end)."""
    result = fit(tmp_path, Scenario(inject="1:2:validation", val_every=4, num_workers=2))
    step = assert_unison_stop(result)
    assert_stopped_after(step, 4)  # validation runs after the 4th step; the signal came inside it
    resumed = fit(tmp_path, Scenario(resume=True, val_every=4, num_workers=2))
    assert_finished(resumed, steps=12)


# prediction's stop: test_prediction_with_uneven_shards
@patched
@pytest.mark.parametrize("stage", ["validate", pytest.param("test", marks=pytest.mark.extended)])
def test_signal_during_evaluation_stages(tmp_path: Path, stage: str) -> None:
    """trainer.validate and trainer.test stop in unison, with no checkpoint."""
    assert_unison_stop(fit(tmp_path, Scenario(inject="1:2:validation", stage=stage)), checkpoint=False)


@patched
@pytest.mark.parametrize("inject", ["", "1:2:validation"], ids=["no-signal", "rank1-batch2"])
def test_prediction_with_uneven_shards(tmp_path: Path, inject: str) -> None:
    """Prediction shards without padding: rank 0 predicts one batch more than rank 1. The ranks must
    neither hang nor pair up their agreements wrongly, signal or not. The package stops prediction in unison; the
    patched Lightning, like Lightning with one device, does not stop prediction on SIGTERM: every rank must finish
    its prediction, exit 0, and no rank may wait for another."""
    result = fit(tmp_path, Scenario(inject=inject, stage="predict", uneven=True))
    predicted = {rank: o["predict_batches"] for rank, o in result.outcomes.items()}
    if inject and IMPLEMENTATION == "package":
        assert_unison_stop(result, checkpoint=False, same_boundary=False)
    else:  # the patched Lightning does not stop prediction
        assert_finished(result, steps=0)
        assert predicted == {0: VAL_BATCHES + 1, 1: VAL_BATCHES}, result.describe()


@patched
def test_signal_between_epochs_then_resume(tmp_path: Path) -> None:
    """Epoch-based training (2 epochs of 8 batches, learning rate halved at each epoch end), signal
    at the end of epoch 1."""
    epochs = Scenario(batches=8, max_epochs=2, epoch_lr_decay=True)
    result = fit(tmp_path / "job", replace(epochs, inject="0:8:epoch_end"))
    step = assert_unison_stop(result)
    # the package stops at its next check point, in epoch 2; the patch agrees at the end of epoch 1 already
    assert_stopped_after(step, 8)
    resumed = fit(tmp_path / "job", replace(epochs, resume=True))
    assert_finished(resumed, steps=16)
    assert {o["batches_started"] for o in resumed.outcomes.values()} == {16 - step}, resumed.describe()
    if step == 8:  # stopped on the epoch boundary: the resumed run must end exactly where an uninterrupted one does
        straight = fit(tmp_path / "straight", epochs)
        assert_finished(straight, steps=16)
        weights = {o["weights"] for o in resumed.outcomes.values()} | {o["weights"] for o in straight.outcomes.values()}
        assert len(weights) == 1, "resumed weights differ from an uninterrupted run's"


@patched
def test_signal_after_the_last_step_is_not_lost(tmp_path: Path) -> None:
    """SIGTERM to rank 1 after the last training step. The package stops every rank at its final agreement (143 and
    the checkpoint at step 12); the patched Lightning lets the finished fit end as finished: every rank exits 0 at
    step 12, none waits for another."""
    result = fit(tmp_path, Scenario(inject="1:12:train_end"))
    if IMPLEMENTATION == "package":
        assert assert_unison_stop(result) == 12  # the final agreement at the end of fit
    else:
        assert_signalled_yet_finished(result, steps=12)
        assert result.checkpoints() == [], result.describe()


# -- single process, no signal, opt-out ----------------------------------------------------------
@patched
def test_single_process_stops_without_collective(tmp_path: Path) -> None:
    result = run_job(tmp_path, Scenario(inject="0:3:forward"), mode="single", world_size=1, timeout=MUST_FINISH)
    assert_stopped_after(assert_unison_stop(result), 3)


@patched
def test_no_signal_trains_exactly_like_stock_lightning(tmp_path: Path) -> None:
    """fit, validate, test and predict back to back on 2 ranks: the same weights as stock Lightning, and
    after each run the process holds what stock's holds (threads, the stop signals' handlers, the wakeup
    fd, exit functions): nothing of the fix outlives the run it served."""
    ours = fit(tmp_path / "ours", Scenario(stage="all"))
    # stock: the suite's own environment (released Lightning) with the package opted out
    stock = run_job(tmp_path / "stock", Scenario(stage="all"), timeout=MUST_FINISH, env={"DDP_SIGTERM": "0"},
                    python=sys.executable)
    assert_finished(ours, steps=12)
    assert_finished(stock, steps=12, stock=True)
    package = IMPLEMENTATION == "package"
    assert all(("UnisonStop" in o["callbacks"]) == package for o in ours.outcomes.values()), ours.describe()
    assert all("UnisonStop" not in o["callbacks"] for o in stock.outcomes.values()), stock.describe()
    assert {o["weights"] for o in ours.outcomes.values()} == {o["weights"] for o in stock.outcomes.values()}
    assert ours.checkpoints() == []
    for label in ours.logs:  # a run that gets no signal logs nothing (Lightning names the entry point)
        said = re.findall(r".*ddp_sigterm(?: [A-Z]+ |: ).*", ours.log(label))
        assert said == [], f"{label}: {said}\n{ours.describe()}"
    # the patched build destroys a gloo default group at exit (PR 2), as Lightning does for NCCL: its purpose
    by_design = {"lightning.fabric.utilities.distributed._destroy_dist_connection"} if not package else set()
    for rank in range(2):
        for stage, left in stock.outcomes[rank]["left_behind"].items():
            ours_left = ours.outcomes[rank]["left_behind"][stage]
            ours_left["exit_functions"] = [f for f in ours_left["exit_functions"] if f not in by_design]
            assert ours_left == left, \
                f"rank {rank} after {stage}: {ours.outcomes[rank]['left_behind'][stage]}, stock: {left}\n" \
                f"{ours.describe()}"


@patched
@pytest.mark.parametrize(("mode", "signalled"), [("lightning", False), ("independent", True)],
                         ids=["no-signal-lightning", "sigterm-rank0-in-test-independent"])
def test_one_device_test_after_a_multi_device_fit(tmp_path: Path, mode: str, signalled: bool) -> None:
    """Lightning's documentation advises testing on one device after a multi-device fit, in the same
    script: rank 0 then builds a one-device Trainer while the default group still holds both ranks. That
    Trainer agrees with no one: no signal, it finishes like stock; SIGTERM to rank 0 during its test
    stops it like any single-process run (143, no checkpoint), while rank 1 has long exited 0."""
    outside = OutsideSignal(rank=0, batch=2, targets="rank:0", phase="then") if signalled else None
    result = run_job(tmp_path, Scenario(then_test_on_one_device=True, val_sleep=0.3), mode=mode,
                     timeout=MUST_FINISH, outside=outside)
    why = result.describe()
    assert not result.timed_out, f"hung\n{why}"
    assert sorted(result.outcomes) == [0, 1], why
    assert result.outcomes[1]["exception"] is None, why
    assert result.outcomes[1]["global_step"] == 12, why
    rank0 = result.outcomes[0]
    rank0_code = result.returncodes["launcher" if mode == "lightning" else "rank0"]
    if not signalled:
        assert (rank0["exception"], rank0["then"]) == (None, "finished"), why
        assert set(result.returncodes.values()) == {0}, why
        return
    assert outside.sent_at is not None, why
    assert (rank0["exception"], rank0["exit_code"], rank0["then"]) == ("SIGTERMException", SIGTERM_EXIT, "started"), why
    assert rank0_code == SIGTERM_EXIT, why
    if mode == "independent":
        assert result.returncodes["rank1"] == 0, why
    if IMPLEMENTATION == "package":
        assert rank0["stop"] is not None, why
    assert result.checkpoints() == [], why


@pytest.mark.extended  # make test's 10 minutes
def test_opt_out_shows_the_stock_failure(tmp_path: Path) -> None:
    """Sensitivity: the seed scenario without the package must fail the way stock Lightning does
    (a hang cut off by the harness, or ranks out of step), so the suite proves it catches the bug."""
    result = run_job(tmp_path, Scenario(inject="0:2:forward"), timeout=HANG_BOUND, env={"DDP_SIGTERM": "0"},
                     python=sys.executable)
    out_of_step = len(set(result.steps().values())) > 1 or len(result.outcomes) < result.world_size
    not_143 = any(o["exit_code"] != SIGTERM_EXIT for o in result.outcomes.values())
    print(f"stock outcome: timed_out={result.timed_out} steps={result.steps()} out_of_step={out_of_step}")
    assert result.timed_out or out_of_step or not_143, result.describe()
