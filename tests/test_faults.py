"""Faults a real cluster produces: a stuck or dead peer, repeated signals, SLURM's requeue signal,
aborts at interpreter exit, bad input. Real jobs through the harness, as in test_scenarios."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from ddp_sigterm_tests.harness import OutsideSignal, run_job, scontrol_calls, stub_scontrol
from ddp_sigterm_tests.helpers import (
    MUST_FINISH,
    SIGTERM_EXIT,
    assert_finished,
    assert_stopped_after,
    assert_unison_stop,
    fit,
)
from ddp_sigterm_tests.scenario import Scenario

from ddp_sigterm._core.exit_codes import GAVE_UP, STOP_FAILED

pytestmark = pytest.mark.scenario

DEADLINE = 5.0  # DDP_SIGTERM_STOP_DEADLINE in these tests: short, so that giving up is quick to see
EXIT_SLACK = 10.0  # from the deadline to the exit the harness sees, on 2 busy cores
LONG = Scenario(max_steps=400, batches=400)  # still training when the fault comes
WITH_DEADLINE = {"DDP_SIGTERM_STOP_DEADLINE": str(DEADLINE)}
# Runs per exit-code test (make test-extended); EXIT_CODE_RUNS=50 for the record in docs/reliability.md.
EXIT_CODE_RUNS = int(os.environ.get("EXIT_CODE_RUNS", "2"))


# -- the package's own group cannot be made --------------------------------------------------------
def test_package_steps_aside_when_its_group_cannot_connect(tmp_path: Path) -> None:
    """Rank 1's gloo cannot make the package's group (its GLOO_SOCKET_IFNAME names no interface once the
    training's group is made) while rank 0 waits for it: within connect_timeout both learn it, rank 0
    warns once, naming the cause and GLOO_SOCKET_IFNAME, and the run trains to its end as without the package
    (gloo's occasional abort at exit included, as in any run without a stop)."""
    result = run_job(tmp_path, Scenario(gloo_ifname=(1, "nosuch0")), timeout=MUST_FINISH,
                     env={"DDP_SIGTERM_CONNECT_TIMEOUT": "5"})
    assert_finished(result, steps=12, stock=True)
    why, log = result.describe(), result.log("rank0")
    assert log.count("ddp_sigterm steps aside for this run") == 1, why
    for said in ("global rank 1: ", "nosuch0", "GLOO_SOCKET_IFNAME="):
        assert said in log, why
    assert "steps aside" not in result.log("rank1"), why


# -- a peer that cannot take part ------------------------------------------------------------------
def test_stuck_peer_signalled_rank_gives_up_at_the_deadline(tmp_path: Path) -> None:
    """Rank 0 is frozen (SIGSTOP: a hung node); rank 1, blocked in the step's gradient all-reduce
    waiting for it, gets SIGTERM. Its Python handler cannot run until the all-reduce returns (30
    minutes), so the deadline thread must end it, saying what it waited for."""
    freeze = OutsideSignal(rank=0, batch=3, targets="rank:0", signum=signal.SIGSTOP)
    term = OutsideSignal(rank=0, batch=3, targets="rank:1", delay=1.0)
    result = run_job(tmp_path, LONG, timeout=MUST_FINISH, outside=[freeze, term], until_exited={"rank1"},
                     env=WITH_DEADLINE)
    why = result.describe()
    assert term.sent_at is not None, why
    assert not result.timed_out, why
    took = result.exited_at["rank1"] - term.sent_at
    print(f"rank 1 exited {took:.1f} s after its SIGTERM (stop_deadline {DEADLINE:g} s)")
    assert result.returncodes["rank1"] == GAVE_UP, why
    assert DEADLINE - 0.5 <= took <= DEADLINE + EXIT_SLACK, why
    # blocked in the step's all-reduce, or in the agreement if the freeze came after rank 0's last step
    log = result.log("rank1")
    gave_up = "ddp_sigterm: rank 1 of 2: the stop did not complete within stop_deadline=5 s of the first SIGTERM"
    assert gave_up in log, why
    assert ("it was waiting for the next step boundary after step" in log
            or "it was waiting for the stop agreement at step" in log), why
    # and where: every thread's stack, the main thread's inside the training script
    stacks = log.split("Where each thread of the process was:", 1)[1]
    assert "Thread 0x" in stacks, why
    assert "scenario_train.py" in stacks, why
    assert result.checkpoints() == [], why


@pytest.mark.extended  # make test's 6 minutes: the stuck peer's test stays there
def test_dead_peer_signalled_rank_exits_nonzero_within_the_deadline(tmp_path: Path) -> None:
    """Rank 0 is killed (SIGKILL: a lost node), and rank 1, waiting for it in the step's all-reduce, gets
    SIGTERM right after. Rank 1 must neither claim a clean stop nor hang: it exits non-zero, naming the
    failure, within the deadline. (gloo notices the closed connection at once, so the error usually
    wins; a SIGTERM that arrives once the run has ended finds the default handler back and ends the
    exit with -15.)"""
    kill = OutsideSignal(rank=0, batch=3, targets="rank:0", signum=signal.SIGKILL)
    term = OutsideSignal(rank=0, batch=3, targets="rank:1")
    result = run_job(tmp_path, LONG, timeout=MUST_FINISH, outside=[kill, term], until_exited={"rank0", "rank1"},
                     env=WITH_DEADLINE)
    why = result.describe()
    assert kill.sent_at is not None, why
    assert not result.timed_out, why
    assert result.returncodes["rank0"] == -signal.SIGKILL, why
    code = result.returncodes["rank1"]
    took = result.exited_at["rank1"] - kill.sent_at
    print(f"rank 1 exited with code {code} {took:.1f} s after rank 0 was killed")
    assert code not in (0, None), why
    assert took <= DEADLINE + EXIT_SLACK, why
    outcome = result.outcomes.get(1)
    assert outcome is None or outcome["exception"] != "SIGTERMException", why
    log = result.log("rank1")
    assert "ddp_sigterm: rank 1 of 2" in log or "Connection reset by peer" in log or "Connection closed" in log, why
    assert result.checkpoints() == [], why


# -- repeated signals ------------------------------------------------------------------------------
def test_second_signal_during_the_save_does_not_interrupt_it(tmp_path: Path) -> None:
    result = fit(tmp_path, Scenario(inject="1:2:forward;0:*:save;1:*:save"))
    step = assert_unison_stop(result)  # includes: the checkpoint loads and holds the stop step
    assert_stopped_after(step, 2)
    resumed = fit(tmp_path, Scenario(resume=True))
    assert_finished(resumed, steps=12)


@pytest.mark.extended  # make test's 6 minutes: the second signal's test stays there
def test_third_signal_ends_the_process_at_once(tmp_path: Path) -> None:
    """The documented escalation: a third stop request (2 s apart) ends the process now, mid-save; its peer
    then cannot complete the stop either and exits non-zero; no checkpoint claims to be complete."""
    result = run_job(tmp_path, Scenario(inject="1:2:forward;1:*:save;1:*:save", signal_gap=2),
                     timeout=MUST_FINISH, until_exited={"rank0", "rank1"},
                     env={"DDP_SIGTERM_STOP_DEADLINE": "60"})  # the signals end it, not the deadline
    why = result.describe()
    assert not result.timed_out, why
    assert result.returncodes["rank1"] == GAVE_UP, why
    assert result.elapsed < 60, why  # well before the deadline
    assert ("ddp_sigterm: rank 1 of 2: SIGTERM received a third time (at least 1 s apart); it was waiting for"
            in result.log("rank1")), why
    assert result.returncodes["rank0"] not in (0, SIGTERM_EXIT, None), why
    assert result.checkpoints() == [], why


# -- SLURM auto-requeue ----------------------------------------------------------------------------
# The job id of an array job and SLURM's preemption are read in tests/unit/test_slurm.py, and a real preemption is
# requeued in tests/test_slurm.py; both signals at once (the agreed one is SIGTERM) and a failing requeue in make
# test-extended, and so is a SIGTERM whose preemption scontrol cannot tell.
@pytest.mark.parametrize("case", ["job", pytest.param("with-sigterm", marks=pytest.mark.extended),
                                  pytest.param("scontrol-fails", marks=pytest.mark.extended),
                                  pytest.param("cannot-tell", marks=pytest.mark.extended)])
def test_slurm_requeue_signal_stops_in_unison_and_requeues_once(tmp_path: Path, case: str) -> None:
    """Under SLURM (its variables set, a stub ``scontrol`` on PATH that records its arguments) the
    requeue signal, SIGUSR1, reaches rank 1 (``with-sigterm``: and SIGTERM rank 0): every rank stops at the same
    step and saves, global rank 0 requeues the job exactly once, and the ranks exit 128 + the agreed signal.
    tests/test_slurm.py does it on a real cluster. ``cannot-tell``: SIGTERM, and ``scontrol show job`` fails:
    rank 0 warns, nothing is requeued, the stop ends as any other (143)."""
    fails = case in ("scontrol-fails", "cannot-tell")
    env = stub_scontrol(tmp_path, fail="Access/permission denied" if fails else None)
    inject = {"with-sigterm": "1:2:forward:SIGUSR1;0:2:forward:SIGTERM",
              "cannot-tell": "1:2:forward:SIGTERM"}.get(case, "1:2:forward:SIGUSR1")
    result = run_job(tmp_path / "job", Scenario(inject=inject), mode="slurm", timeout=MUST_FINISH, env=env)
    why = result.describe()
    assert {o.get("environment") for o in result.outcomes.values()} == {"SLURMEnvironment"}, why
    if case == "cannot-tell":
        assert scontrol_calls(env) == ["show job --oneliner 4242"], why
        warning = ("scontrol show job --oneliner 4242 failed with exit code 1: slurm_requeue error: Access/permission "
                   "denied; cannot tell whether SLURM is preempting the job: it is not requeued")
        assert warning in result.log("rank0"), why
        assert_stopped_after(assert_unison_stop(result, exit_code=128 + signal.SIGTERM), 2)
        return
    assert scontrol_calls(env) == ["requeue 4242"], why
    if case == "scontrol-fails":  # the checkpoint is saved, but the job would not come back: say so, everywhere
        assert not result.timed_out, why
        assert set(result.returncodes.values()) == {STOP_FAILED}, why
        assert len({o["global_step"] for o in result.outcomes.values()}) == 1, why
        assert "scontrol requeue 4242 failed with exit code 1: slurm_requeue error" in result.log("rank0"), why
        assert "but requeueing the SLURM job failed on rank 0" in result.log("rank1"), why
        assert len(result.checkpoints()) == 1, why
        return
    signum = signal.SIGTERM if case == "with-sigterm" else signal.SIGUSR1
    assert_stopped_after(assert_unison_stop(result, exit_code=128 + signum), 2)


# -- exit codes, every time ------------------------------------------------------------------------
@pytest.mark.extended
@pytest.mark.parametrize("outcome", ["finished", "stopped"])
def test_exit_codes_every_time(tmp_path: Path, outcome: str) -> None:
    """gloo sometimes aborts at interpreter exit ("terminate called without an active exception", -6)
    when a group is still alive; the package destroys its own groups at the end of every run, and the
    default group at exit after an agreed stop."""
    expected = 0 if outcome == "finished" else SIGTERM_EXIT
    seen = []
    for run in range(EXIT_CODE_RUNS):
        result = fit(tmp_path / str(run), Scenario(inject="1:2:forward" if outcome == "stopped" else "", max_steps=4))
        logs = "".join(map(result.log, result.logs))
        seen.append(sorted(result.returncodes.values()))
        assert "terminate called" not in logs, result.describe()
        assert set(result.returncodes.values()) == {expected}, result.describe()
    print(f"{outcome}: {len(seen)} runs, exit codes {seen}")


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("env", "message"), [
    pytest.param({"DDP_SIGTERM_STOP_DEADLINE": "soon"}, "DDP_SIGTERM_STOP_DEADLINE='soon': expected a number",
                 marks=pytest.mark.extended),
    ({"DDP_SIGTERM_DEADLINE": "5"}, "Unknown environment variable(s) DDP_SIGTERM_DEADLINE"),
], ids=["bad-value", "unknown-variable"])  # every message: tests/unit/core/test_settings.py
def test_bad_settings_stop_the_job_before_training_with_the_reason(tmp_path: Path, env: dict, message: str) -> None:
    result = run_job(tmp_path, timeout=MUST_FINISH, env=env)
    why = result.describe()
    assert not result.timed_out, why
    assert set(result.returncodes.values()) == {1}, why
    for label in result.logs:
        assert message in result.log(label), why
    assert not list(tmp_path.glob("progress.rank*")) or all(
        "train" not in p.read_text() for p in tmp_path.glob("progress.rank*")), why


@pytest.mark.extended  # make test's 6 minutes: a failed save's exit is test_storage.py's, in make test
def test_checkpoint_directory_not_writable_at_stop(tmp_path: Path) -> None:
    """default_root_dir becomes non-writable just before the signal: the ranks still stop together, at
    the same step, and every rank exits non-zero with the reason; nothing claims to be a checkpoint."""
    root = tmp_path / "root"
    root.mkdir()
    if os.geteuid() == 0 and not _can_make_immutable(tmp_path / "probe"):
        pytest.xfail("running as root without chattr +i (no CAP_LINUX_IMMUTABLE, or tmpfs): cannot make "
                     "default_root_dir non-writable here")
    try:
        result = fit(tmp_path, Scenario(inject="1:2:forward", root_dir=str(root), lock_root=True))
    finally:
        _unlock(root)
    why = result.describe()
    assert not result.timed_out, why
    assert set(result.returncodes.values()) == {STOP_FAILED}, why
    outcomes = result.outcomes
    assert sorted(outcomes) == [0, 1], why
    assert len({o["global_step"] for o in outcomes.values()}) == 1, why
    assert all(o["exception"].startswith("StopError") for o in outcomes.values()), why
    assert "but saving the stop checkpoint of step" in outcomes[0]["exception"], why
    assert any(reason in outcomes[0]["exception"] for reason in ("Permission denied", "Operation not permitted")), why
    assert "failed on rank 0 (its log has the reason)" in outcomes[1]["exception"], why
    assert list(root.glob("hpc_ckpt_*")) == [], why


def _can_make_immutable(probe: Path) -> bool:
    probe.mkdir()
    made = subprocess.run(["chattr", "+i", str(probe)], capture_output=True, check=False).returncode == 0
    _unlock(probe)
    return made


def _unlock(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)
    path.chmod(0o755)
