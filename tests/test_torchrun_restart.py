"""torchrun's own restart after an agreed stop: ``torchrun --max-restarts=3``, SIGTERM to one worker in
the first attempt, every rank stops at the same step and exits 143, torchrun starts the group again,
the new attempt resumes (``DDP_SIGTERM_RESUME=1``) and finishes with exactly ``max_steps`` and an
uninterrupted run's weights. The restart needs the workaround of docs/torchrun.md (repro/torchrun_restart:
without it the new attempt often fails to connect). ``make test`` runs it once; ``make test-extended``
three times in a row (the examples under the same restart are in test_examples.py).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from ddp_sigterm_tests.harness import run_job
from ddp_sigterm_tests.helpers import MUST_FINISH, assert_finished, torchrun_restarts
from ddp_sigterm_tests.scenario import Scenario

pytestmark = pytest.mark.scenario
MAX_STEPS = 10
TRAINING = Scenario(data_by_step=True, batches=4, max_steps=MAX_STEPS)
RESUME = {"DDP_SIGTERM_RESUME": "1"}  # a relaunch resumes by itself



def restarted_job(out: Path, signal_rank: int = 1):
    return run_job(out, replace(TRAINING, inject=f"{signal_rank}:3:forward"), mode="torchrun", timeout=MUST_FINISH,
                   env={**RESUME, **torchrun_restarts()})


def straight_weights(out: Path) -> set[str]:
    straight = run_job(out, TRAINING, mode="independent", timeout=MUST_FINISH, env=RESUME)
    assert_finished(straight, steps=MAX_STEPS)
    return {o["weights"] for o in straight.outcomes.values()}


def assert_restarted_and_finished(result, weights: set[str]) -> None:
    why = result.describe()
    assert result.returncodes == {"torchrun": 0}, why
    assert_finished(result, steps=MAX_STEPS)
    assert {o["attempt"] for o in result.outcomes.values()} == {1}, why  # the second attempt finished
    steps = [int(line.split()[3]) for line in (result.out / "progress.rank0").read_text().splitlines()
             if line.startswith("train ")]  # "train <batch> step <global step> ...", both attempts
    assert 0 not in steps[1:], f"the second attempt started from step 0, not from the stop\n{why}"
    assert {o["weights"] for o in result.outcomes.values()} == weights, f"not an uninterrupted run's weights\n{why}"
    assert len(list(result.out.glob("hpc_ckpt_*.ckpt"))) == 1, why


def test_torchrun_restarts_the_stopped_group_which_resumes(tmp_path: Path) -> None:
    weights = straight_weights(tmp_path / "straight")
    assert_restarted_and_finished(restarted_job(tmp_path / "job"), weights)


@pytest.mark.extended
def test_without_the_workaround_the_package_warns_before_any_restart(tmp_path: Path) -> None:
    """torchrun's default (static) rendezvous with --max-restarts: nothing to restart yet, but rank 0
    says, once, what a restart would meet and what to run instead; with the workaround it says nothing."""
    shared = run_job(tmp_path / "shared", TRAINING, mode="torchrun", timeout=MUST_FINISH,
                     env={**RESUME, "PET_MAX_RESTARTS": "3"})
    assert_finished(shared, steps=MAX_STEPS)
    assert shared.log("torchrun").count("torchrun may restart this job (--max-restarts=3)") == 1, shared.describe()
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --rdzv-backend=c10d" in shared.log("torchrun")
    own = run_job(tmp_path / "own", TRAINING, mode="torchrun", timeout=MUST_FINISH,
                  env={**RESUME, **torchrun_restarts()})
    assert_finished(own, steps=MAX_STEPS)
    assert "torchrun may restart this job" not in own.log("torchrun"), own.describe()


@pytest.mark.extended
def test_torchrun_restart_three_in_a_row(tmp_path: Path) -> None:
    weights = straight_weights(tmp_path / "straight")
    for run in range(int(os.environ.get("TORCHRUN_RESTART_RUNS", "3"))):
        assert_restarted_and_finished(restarted_job(tmp_path / f"job{run}", signal_rank=run % 2), weights)
