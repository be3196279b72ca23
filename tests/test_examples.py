"""The examples in examples/, run as a user runs them: SIGTERM to a non-zero rank from outside, then
the same command again. Every rank must report the same stop step, one checkpoint must hold it, the
job must exit 128 + 15, and the second run must resume from that step and finish with exit 0.

Each example prints ``[rank R] pid P, starting at step S``, ``[rank R] step N`` after every optimizer
step, and ``[rank R] stopped at step N ...`` or ``[rank R] finished at step N``. The ranks share one
output file, and an unbuffered ``print`` writes its text and its newline separately, so lines of two
ranks may run together: the patterns below are not anchored to line starts.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest
from ddp_sigterm_tests.harness import IMPLEMENTATION, PYTHON, Supervised, free_port, supervise
from ddp_sigterm_tests.helpers import (
    SignalAfterStep,
    assert_trainer_example_went_on,
    per_rank,
    saved_step,
    steps_done,
    torchrun_restarts,
)

pytestmark = pytest.mark.scenario

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MUST_FINISH = 180.0
MAX_STEPS = 60
SIGNALLED_RANK, SIGNAL_AFTER_STEP = 1, 3


def command(example: str, launcher: str, root: Path) -> tuple[str, list[str]]:
    """(label, argv) for launching ``example`` with 2 ranks: by ``torchrun``, or by the script itself
    (``lightning``: the Trainer's or Fabric's own launcher starts rank 1)."""
    args = [str(EXAMPLES / f"{example}.py"), "--root", str(root), "--max-steps", str(MAX_STEPS)]
    if IMPLEMENTATION == "patched":  # that Lightning stops every rank together; OnExceptionCheckpoint saves the stop
        args.append("--on-exception-checkpoint")
    if launcher == "torchrun":
        return "torchrun", [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
                            "--master-addr=127.0.0.1", *args]
    return "launcher", [PYTHON, *args]


def run(example: str, launcher: str, out: Path, root: Path, signal_rank: int | None,
        signum: int = signal.SIGTERM, env: dict[str, str] | None = None) -> Supervised:
    """Run the example with its checkpoints in ``root`` and its output in ``out``; send ``signum`` to
    ``signal_rank`` after its step 3."""
    label, argv = command(example, launcher, root)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), **(env or {})}
    for var in ("WORLD_SIZE", "RANK", "NODE_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    log = out / f"{label}.log"
    signalled = SignalAfterStep(lambda: log.read_text(errors="replace"), signal_rank, SIGNAL_AFTER_STEP, signum) \
        if signal_rank is not None else None
    out.mkdir(parents=True, exist_ok=True)
    # the launcher is rank 0: give the ranks it started time to finish their own exit too
    result = supervise(out, {label: (argv, env)}, MUST_FINISH, on_poll=signalled, linger=30.0)
    assert not result.timed_out, f"{example} did not finish in {MUST_FINISH} s\n{tail(result)}"
    assert not result.left_behind, f"processes {result.left_behind} outlived the launcher by 30 s\n{tail(result)}"
    if signalled is not None:
        assert signalled.sent, f"rank {signal_rank} never reached step {SIGNAL_AFTER_STEP}\n{tail(result)}"
    return result


def tail(result: Supervised) -> str:
    return "\n".join(result.output().splitlines()[-60:])








def assert_stopped_in_unison(example: str, launcher: str, stopped: Supervised, root: Path, signum: int) -> int:
    """Both ranks stopped at the same step, none went past it, the job exited 128 + ``signum``, and the
    one checkpoint holds that step; returns it."""
    text, why = stopped.output(), tail(stopped)
    stops = per_rank(r"stopped at step (\d+)", text)
    assert sorted(stops) == [0, 1], f"not every rank reported a stop\n{why}"
    assert len(set(stops.values())) == 1, f"ranks stopped at different steps {stops}\n{why}"
    (step,) = set(stops.values())
    assert SIGNAL_AFTER_STEP <= step < MAX_STEPS, f"stopped at {step}\n{why}"
    done = steps_done(text)
    assert all(max(done[rank]) == step for rank in (0, 1)), f"a rank went past the stop step\n{why}"
    if launcher == "torchrun":  # torchrun reports its workers' exit codes as a failure
        assert stopped.returncodes["torchrun"] != 0, why
        codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", text))
        assert codes == {str(128 + signum)}, f"torchrun saw worker exit codes {codes}, not {128 + signum}\n{why}"
    else:
        assert stopped.returncodes["launcher"] == 128 + signum, f"exit code {stopped.returncodes}\n{why}"
    _, held = saved_step(example, root)
    assert held == step, f"the checkpoint holds step {held}, the ranks stopped at {step}\n{why}"
    return step


# The Trainer example never imports ddp_sigterm: it holds for the patched Lightning too (make test-patched).
# make test: the Trainer's own launcher and torchrun once each (Fabric's stop: the SIGINT test below); Fabric's own
# launcher in make test-extended (the Trainer under torchrun: test_scenarios.py::test_launchers; Fabric under torchrun:
# test_multinode.py).
@pytest.mark.parametrize(("example", "launcher"), [
    pytest.param("trainer", "lightning", marks=pytest.mark.patched),
    pytest.param("fabric", "lightning", marks=pytest.mark.extended),
    ("plain_torch", "torchrun"),
])
def test_example_stops_in_unison_when_rank_1_is_signalled_and_resumes(example: str, launcher: str,
                                                                      tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    stopped = run(example, launcher, tmp_path / "stopped", root, signal_rank=SIGNALLED_RANK)
    text, why = stopped.output(), tail(stopped)
    if example == "trainer":  # the fix that ran is the one under test
        registered = "Adding 1 callbacks from entry point 'ddp_sigterm'" in text
        assert registered == (IMPLEMENTATION == "package"), \
            f"{IMPLEMENTATION}: the package's entry point registered={registered}\n{why}"
    step = assert_stopped_in_unison(example, launcher, stopped, root, signal.SIGTERM)

    resumed = run(example, launcher, tmp_path / "resumed", root, signal_rank=None)
    text, why = resumed.output(), tail(resumed)
    assert per_rank(r"pid \d+, starting at step (\d+)", text) == {0: step, 1: step}, f"did not resume\n{why}"
    assert per_rank(r"finished at step (\d+)", text) == {0: MAX_STEPS, 1: MAX_STEPS}, f"did not finish\n{why}"
    expected = list(range(step + 1, MAX_STEPS + 1))
    assert steps_done(text) == {0: expected, 1: expected}, f"the resumed run did not do exactly the rest\n{why}"
    assert set(resumed.returncodes.values()) == {0}, f"exit code {resumed.returncodes}\n{why}"
    if example == "trainer":
        assert_the_log_and_the_data_went_on(root, text, why)
    else:  # its checkpoint holds its StatefulDataLoader's position (4 batches an epoch: the stop is in a later one)
        assert_the_weights_of_an_uninterrupted_run(example, launcher, tmp_path, text)


def assert_the_weights_of_an_uninterrupted_run(example: str, launcher: str, tmp_path: Path, text: str) -> None:
    """The loop examples end, after a stop and a resume, with the weights of a run that was never stopped: the
    resume trained on the batches that run trained on after the stop, in its order."""
    straight = run(example, launcher, tmp_path / "straight", tmp_path / "straight-checkpoints", signal_rank=None)
    finished = re.findall(r"\[rank \d+\] finished at step (\d+), weights (\w+)", text + straight.output())
    assert len(finished) == 4, tail(straight)
    assert set(finished) == {(str(MAX_STEPS), finished[0][1])}, f"not an uninterrupted run's weights: {finished}"


def assert_the_log_and_the_data_went_on(root: Path, text: str, why: str) -> None:
    """The Trainer example's resume: with the package, see :func:`assert_trainer_example_went_on`; the patched
    Lightning, without the package, makes a new version."""
    if IMPLEMENTATION == "patched":
        versions = sorted(path.name for path in (root / "lightning_logs").iterdir())
        assert versions == ["version_0", "version_1"], f"{versions}\n{why}"
    else:
        assert_trainer_example_went_on(root, text, MAX_STEPS, why)


@pytest.mark.extended  # the Trainer's: test_torchrun_restart.py
@pytest.mark.parametrize("example", ["fabric"])
def test_example_resumes_in_torchruns_own_restart(example: str, tmp_path: Path) -> None:
    """torchrun --max-restarts=3 with the workaround of docs/torchrun.md: SIGTERM to rank 1, every rank stops at the
    same step, torchrun starts the group again, the example resumes from that step by itself, ends with an
    uninterrupted run's weights, and torchrun exits 0."""
    restarted = run(example, "torchrun", tmp_path / "restarted", tmp_path / "checkpoints", signal_rank=SIGNALLED_RANK,
                    env=torchrun_restarts())
    text, why = restarted.output(), tail(restarted)
    stops = per_rank(r"stopped at step (\d+)", text)
    assert sorted(stops) == [0, 1], why
    assert len(set(stops.values())) == 1, why
    starts = sorted(re.findall(r"\[rank (\d+)\] pid \d+, starting at step (\d+)", text))
    assert starts == sorted([("0", "0"), ("1", "0"), ("0", str(stops[0])), ("1", str(stops[0]))]), why
    assert restarted.returncodes == {"torchrun": 0}, why
    assert_the_weights_of_an_uninterrupted_run(example, "torchrun", tmp_path, text)


# SIGINT (whose default handler Python implements as a function) in make test; SIGUSR1 (whose default is death) in
# make test-extended. One handler serves every listed signal, whatever the loop (the Trainer's included).
@pytest.mark.parametrize(("example", "launcher", "name"), [
    ("fabric", "lightning", "SIGINT"),
    pytest.param("plain_torch", "torchrun", "SIGUSR1", marks=pytest.mark.extended),
])
def test_every_listed_stop_signal_stops_in_unison(example: str, launcher: str, name: str, tmp_path: Path) -> None:
    """``DDP_SIGTERM_SIGNALS`` lists more stop signals than SIGTERM: each of them, sent to rank 1 alone,
    stops every rank at the same step with exit code 128 + that signal (not its default action: SIGINT's
    KeyboardInterrupt, SIGUSR1's death)."""
    signum = signal.Signals[name]
    root = tmp_path / "checkpoints"
    stopped = run(example, launcher, tmp_path / "stopped", root, signal_rank=SIGNALLED_RANK, signum=signum,
                  env={"DDP_SIGTERM_SIGNALS": "SIGTERM,SIGINT,SIGUSR1,SIGUSR2"})
    assert_stopped_in_unison(example, launcher, stopped, root, signum)
    assert f"by {name}" in stopped.output(), tail(stopped)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
