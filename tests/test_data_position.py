"""Issue 38: a stop and its resume give back the training data's position, not only the weights. Real two-rank
Trainer jobs (tests/support/scenario_train.py) that record the dataset indices of every batch each rank trains on;
the stop is a SIGTERM to rank 1 inside the second epoch, the resume the same command with ``ckpt_path="hpc"``."""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ddp_sigterm_tests.harness import JobResult
from ddp_sigterm_tests.helpers import assert_finished, assert_unison_stop, fit
from ddp_sigterm_tests.scenario import Scenario

pytestmark = pytest.mark.scenario

# 20 batches per rank and epoch, shuffled by epoch: 50 steps are two and a half epochs
STATEFUL = Scenario(train_loader="stateful", shuffle="sampler", record_samples=True, batches=20, max_steps=50,
                    keep_weights=True)
STOP = "1:25:forward"  # rank 1 in its 25th batch; agreed within 0.2 s (10 steps): inside the second epoch
ENV = {"DDP_SIGTERM_MAX_DELAY": "0.2"}
NOT_SAVED = "the training DataLoader's position in its epoch is not saved"


def samples(result: JobResult) -> dict[int, list[str]]:
    """rank -> the lines of ``samples.rank<R>``: ``<global step> <index> ...`` per step, of every job run in
    ``result``'s directory so far."""
    return {rank: (result.out / f"samples.rank{rank}").read_text().splitlines() for rank in (0, 1)}


def weights(result: JobResult) -> dict[str, torch.Tensor]:
    return torch.load(result.out / "weights.rank0.pt")


@pytest.mark.parametrize(("num_workers", "shuffle"), [
    (2, "sampler"), pytest.param(0, "", marks=pytest.mark.extended), pytest.param(2, "", marks=pytest.mark.extended),
    pytest.param(0, "sampler", marks=pytest.mark.extended)])
def test_a_stateful_loader_resumes_at_the_batch_after_the_stop(tmp_path: Path, num_workers: int, shuffle: str) -> None:
    """torchdata's StatefulDataLoader, over the DistributedSampler Lightning puts in (``""``: it shuffles the training
    data by epoch) or over torchdata's StatefulDistributedSampler (``sampler``), with 0 or 2 workers: over the stop
    (inside the second epoch) and the resume, each rank trains on exactly the batches of an uninterrupted run, in its
    order (none twice, none skipped), and ends with its weights; the stop does not say that the position is lost.
    (Lightning gives the positions back before it sets the samplers' epoch: without the package the rest of the
    epoch is epoch 0's order.)"""
    scenario = replace(STATEFUL, num_workers=num_workers, shuffle=shuffle)
    straight = fit(tmp_path / "straight", scenario)
    assert_finished(straight, steps=scenario.max_steps)
    stopped = fit(tmp_path / "run", replace(scenario, inject=STOP), env=ENV)
    step = assert_unison_stop(stopped)
    assert scenario.batches < step < 2 * scenario.batches, stopped.describe()
    assert NOT_SAVED not in stopped.log("rank0"), stopped.describe()
    resumed = fit(tmp_path / "run", replace(scenario, resume=True))
    assert_finished(resumed, steps=scenario.max_steps)
    assert samples(resumed) == samples(straight), resumed.describe()
    assert "the training loaders resume where the stop left them, in epoch 1" in resumed.log("rank0"), \
        resumed.describe()
    torch.testing.assert_close(weights(resumed), weights(straight), rtol=0, atol=0)


@pytest.mark.extended
def test_a_stateful_loader_resumes_where_lightning_would_drop_its_position(tmp_path: Path) -> None:
    """Lightning #20550: ``configure_optimizers`` reads ``trainer.estimated_stepping_batches`` (as a OneCycleLR
    schedule does), so Lightning sets the training data up before it restores the checkpoint and leaves the loader's
    saved position pending. Stock Lightning's resume (the same checkpoint, ``DDP_SIGTERM=0``) starts the epoch over;
    the package loads the position at the start of training, says so, and the run is an uninterrupted one."""
    scenario = replace(STATEFUL, stepping_batches=True, max_epochs=3)  # (with no max_epochs, Lightning needs no data)
    steps = scenario.max_epochs * scenario.batches
    straight = fit(tmp_path / "straight", scenario)
    assert_finished(straight, steps=steps)
    stopped = fit(tmp_path / "run", replace(scenario, inject=STOP), env=ENV)
    step = assert_unison_stop(stopped)
    shutil.copytree(tmp_path / "run", tmp_path / "stock")
    stock = fit(tmp_path / "stock", replace(scenario, resume=True), env={"DDP_SIGTERM": "0"})
    assert_finished(stock, steps=steps, stock=True)  # stock may abort at exit (gloo), having finished
    assert samples(stock)[0][step].split()[1:] == samples(straight)[0][scenario.batches].split()[1:], \
        "stock Lightning no longer drops the position (#20550 fixed?): the package's part can go"
    resumed = fit(tmp_path / "run", replace(scenario, resume=True))
    assert_finished(resumed, steps=steps)
    assert samples(resumed) == samples(straight), resumed.describe()
    assert "the training loaders resume where the stop left them, in epoch 1" in resumed.log("rank0"), \
        resumed.describe()
    torch.testing.assert_close(weights(resumed), weights(straight), rtol=0, atol=0)


def test_a_plain_loader_stop_says_once_that_the_position_is_not_saved(tmp_path: Path) -> None:
    """torch's DataLoader has no position to save: the resumed run starts the epoch over. The stop says so once,
    on rank 0, with what to use instead; and the resumed run does see the epoch's first batches again."""
    scenario = replace(STATEFUL, train_loader="plain")
    stopped = fit(tmp_path, replace(scenario, inject=STOP), env=ENV)
    step = assert_unison_stop(stopped)
    said = re.findall(rf"{re.escape(NOT_SAVED)}.*", stopped.log("rank0"))
    assert len(said) == 1, stopped.describe()
    assert "StatefulDataLoader" in said[0], said[0]
    assert NOT_SAVED not in stopped.log("rank1"), stopped.describe()
    epoch_start = samples(stopped)[0][scenario.batches].split()[1:]  # the second epoch's first batch, on rank 0
    resumed = fit(tmp_path, replace(scenario, resume=True))
    assert_finished(resumed, steps=scenario.max_steps)
    after_stop = samples(resumed)[0][step].split()
    assert after_stop[0] == str(step), after_stop
    assert after_stop[1:] == epoch_start, "the resumed run did not start the epoch over"
