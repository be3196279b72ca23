"""The heartbeat names the boundary where every rank agrees; after a loop of uneven length the leaving votes
re-sync the ranks' boundary counts. A signal landing around that re-sync must still be agreed at one boundary, on
every rank. Two real ranks of tests/support/uneven_loop.py: the gloo port, the driver and the heartbeat's thread
at 5 ms. The interleavings themselves are the simulation's (tests/unit/core/test_decision.py, 300 seeds, on the
same decision code), so one seed runs in make test and three in make test-extended."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from ddp_sigterm_tests.harness import HERE, free_port, read_outcomes, supervise
from ddp_sigterm_tests.helpers import MUST_FINISH, SIGTERM_EXIT

pytestmark = pytest.mark.scenario

# the seed chooses the signalled rank, the cycle, and where: in the loop, just before leaving it, in training
SEEDS = [pytest.param(seed, marks=[pytest.mark.extended] if seed >= 1 else []) for seed in range(4)]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_signal_around_the_resync_is_agreed_at_one_boundary(tmp_path: Path, seed: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "DDP_SIGTERM_LOG_LEVEL": "WARNING"}
    commands = {f"rank{rank}": ([sys.executable, str(HERE / "uneven_loop.py"), str(seed), str(tmp_path)],
                                {**env, "RANK": str(rank), "LOCAL_RANK": "0"}) for rank in range(2)}
    run = supervise(tmp_path, commands, timeout=MUST_FINISH)
    outcomes = read_outcomes(tmp_path)
    why = f"seed {seed}: {outcomes}\n{run.output()}"
    assert not run.timed_out, f"did not finish within {MUST_FINISH} s (deadlock?)\n{why}"
    assert run.returncodes == {"rank0": SIGTERM_EXIT, "rank1": SIGTERM_EXIT}, why
    stops = [outcomes[rank]["stop"] for rank in (0, 1)]
    assert stops[0]["boundary"] == stops[1]["boundary"], why  # one agreement, at one boundary
    assert stops[0]["step"] == stops[1]["step"], why
    assert stops[0]["signalled_rank"] == stops[1]["signalled_rank"] == outcomes[0]["target"], why
    if "train" in (outcomes[0]["stopped"][0], outcomes[1]["stopped"][0]):  # training steps are even: same place
        assert outcomes[0]["stopped"] == outcomes[1]["stopped"], why
