"""Issues 38 and 49: a stop and its resume give back the training data's position, not only the weights, on the same
ranks or on another number of them. Real Trainer jobs (tests/support/scenario_train.py) that record the dataset
indices of every batch each rank trains on; the stop is a SIGTERM to rank 1 inside the second epoch, the resume the
same command with ``ckpt_path="hpc"``."""

from __future__ import annotations

import re
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ddp_sigterm_tests.harness import HERE, JobResult, run_job
from ddp_sigterm_tests.helpers import MUST_FINISH, SIGTERM_EXIT, assert_finished, assert_unison_stop, fit
from ddp_sigterm_tests.scenario import Scenario
from torch.utils.data import DistributedSampler

pytestmark = pytest.mark.scenario

# 20 batches per rank and epoch, shuffled by epoch: 50 steps are two and a half epochs
STATEFUL = Scenario(train_loader="stateful", shuffle="sampler", record_samples=True, batches=20, max_steps=50,
                    keep_weights=True)
STOP = "1:25:forward"  # rank 1 in its 25th batch; agreed within 0.2 s (10 steps): inside the second epoch
ENV = {"DDP_SIGTERM_MAX_DELAY": "0.2"}
NOT_SAVED = "the training DataLoader's position in its epoch is not saved"


def samples(result: JobResult, ranks: int = 2) -> dict[int, list[str]]:
    """rank -> the lines of ``samples.rank<R>``: ``<global step> <epoch> <index> ...`` per step, of every job run in
    ``result``'s directory so far."""
    return {rank: (result.out / f"samples.rank{rank}").read_text().splitlines() for rank in range(ranks)}


def trained(result: JobResult, ranks: int) -> dict[int, Counter[int]]:
    """epoch -> how often each sample was trained in it, over every rank of every job run in ``result``'s directory."""
    counts: dict[int, Counter[int]] = {}
    for lines in samples(result, ranks).values():
        for line in lines:
            _, epoch, *indices = map(int, line.split())
            counts.setdefault(epoch, Counter()).update(indices)
    return counts


def weights(result: JobResult, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(result.out / f"weights.rank{rank}.pt")


extended = pytest.mark.extended


# Each of workers (0, 2), shuffling (the loader's, the sampler's) and strategy (DDP, FSDP2) at least once.
@pytest.mark.parametrize(("num_workers", "shuffle", "strategy"), [
    (2, "loader", ""), pytest.param(2, "loader", "fsdp2", marks=extended), pytest.param(0, "", "", marks=extended),
    pytest.param(0, "sampler", "", marks=extended)])
def test_a_stateful_loader_resumes_at_the_batch_after_the_stop(tmp_path: Path, num_workers: int, shuffle: str,
                                                              strategy: str) -> None:
    """torchdata's StatefulDataLoader, over the DistributedSampler Lightning puts in (``""``: it shuffles the training
    data by epoch), over torchdata's StatefulDistributedSampler (``sampler``) or shuffling itself (``loader``:
    ``shuffle=True``, torchdata's RandomSampler, which Lightning wraps in its DistributedSamplerWrapper and which
    draws a new order at every iteration), with 0 or 2 workers, DDP or FSDP2: over the stop (inside the second
    epoch) and the resume, each rank trains on exactly the batches of an uninterrupted run, in its order (none twice,
    none skipped), and ends with its weights (under FSDP2, its shards); the stop does not say that the position is
    lost. (Lightning gives the positions back before it sets the samplers' epoch: without the package the rest of the
    epoch is epoch 0's order; with ``shuffle=True`` it is an order of its own, and the next epoch's too.)"""
    scenario = replace(STATEFUL, num_workers=num_workers, shuffle=shuffle, strategy=strategy)
    straight = fit(tmp_path / "straight", scenario)
    assert_finished(straight, steps=scenario.max_steps)
    stopped = fit(tmp_path / "run", replace(scenario, inject=STOP), env=ENV)
    step = assert_unison_stop(stopped)
    assert scenario.batches < step < 2 * scenario.batches, stopped.describe()
    assert NOT_SAVED not in stopped.log("rank0"), stopped.describe()
    if strategy == "fsdp2":
        assert stopped.checkpoints()[0].is_dir(), "FSDP2's stop checkpoint is a folder of shards"
    resumed = fit(tmp_path / "run", replace(scenario, resume=True))
    assert_finished(resumed, steps=scenario.max_steps)
    assert samples(resumed) == samples(straight), resumed.describe()
    assert "the training loaders resume where the stop left them, in epoch 1" in resumed.log("rank0"), \
        resumed.describe()
    for rank in (0, 1):
        torch.testing.assert_close(weights(resumed, rank), weights(straight, rank), rtol=0, atol=0)


# 240 samples, shuffled by the loader, batches of 4: 20 batches per rank and epoch on 3 ranks, 30 on 2; three epochs
ELASTIC = Scenario(train_loader="stateful", shuffle="loader", record_samples=True, samples=240, max_epochs=3,
                   step_sleep=0.005)
RESUMED_ON = re.compile(r"the job resumed on (\d+) ranks where it stopped on (\d+): the global batch size was (\d+), "
                        r"it is (\d+)")
DEALT = re.compile(r"the rest of epoch 1, (\d+) samples not trained yet, is dealt out over the (\d+) data-parallel "
                   r"ranks, each sample once \((\d+) places of padding\)")


@pytest.mark.extended
@pytest.mark.parametrize(("before", "after", "num_workers", "strategy"), [(3, 2, 2, "fsdp2"), (2, 3, 0, "")])
def test_a_resume_on_another_number_of_ranks_trains_the_rest_of_the_epoch_once(
        tmp_path: Path, before: int, after: int, num_workers: int, strategy: str) -> None:
    """Stopped on ``before`` ranks inside the second epoch, resumed on ``after`` (FSDP2's sharded checkpoint
    reshards): over the stop and the resume every sample of the stopped epoch is trained once, but for the places of
    padding the resume names (its rest is dealt out evenly), and the next epoch is stock Lightning's on ``after``
    ranks, each sample once; the run finishes its epochs, exit 0. Rank 0 says once on how many ranks the job stopped
    and resumed, and the global batch size before and after. (Stock Lightning gives every rank the stopped rank 0's
    count of its new share to pass over: 71 samples twice and 39 never, 3 to 2 ranks.)"""
    scenario = replace(ELASTIC, num_workers=num_workers, strategy=strategy)
    per_rank = scenario.samples // before // 4
    stopped = fit(tmp_path, replace(scenario, inject=f"1:{per_rank + 5}:forward"), world_size=before, env=ENV)
    step = assert_unison_stop(stopped)
    assert per_rank < step < 2 * per_rank, stopped.describe()
    resumed = fit(tmp_path, replace(scenario, resume=True), world_size=after)
    why = resumed.describe()
    assert not resumed.timed_out, why
    assert set(resumed.returncodes.values()) == {0}, why
    said = resumed.log("rank0")
    assert RESUMED_ON.findall(said) == [(str(after), str(before), str(4 * before), str(4 * after))], why
    ((left, over, padding),) = DEALT.findall(said)
    assert int(over) == after, why
    counts = trained(resumed, max(before, after))
    assert set(counts) == {0, 1, 2}, why
    assert set(counts[1]) == set(range(scenario.samples)), f"samples never trained in the stopped epoch\n{why}"
    assert sum(counts[1].values()) - scenario.samples == int(padding), f"samples trained twice\n{why}"
    assert int(left) == scenario.samples - before * 4 * (step - per_rank), why
    assert counts[2] == Counter(range(scenario.samples)), f"the epoch after the resumed one\n{why}"
    rest = -(-(int(left) + int(padding)) // after // 4)
    assert set(resumed.steps().values()) == {step + rest + scenario.samples // after // 4}, why
    for rank in range(after):
        assert "cannot be carried" not in resumed.log(f"rank{rank}"), why
        assert (rank == 0) == bool(RESUMED_ON.search(resumed.log(f"rank{rank}"))), why


@pytest.mark.extended
def test_a_loader_whose_place_cannot_be_carried_to_other_ranks_says_so_and_starts_the_epoch_over(
        tmp_path: Path) -> None:
    """torch's DataLoader keeps no position: resumed on 2 ranks where it stopped on 3, rank 0 says once that its place
    cannot be carried, naming both numbers of ranks, and the epoch starts over; the run finishes."""
    scenario = replace(ELASTIC, train_loader="plain", shuffle="", max_epochs=2)
    stopped = fit(tmp_path, replace(scenario, inject="1:25:forward"), world_size=3, env=ENV)
    step = assert_unison_stop(stopped)
    resumed = fit(tmp_path, replace(scenario, resume=True), world_size=2)
    why = resumed.describe()
    assert not resumed.timed_out, why
    assert set(resumed.returncodes.values()) == {0}, why
    said = re.findall(r"ddp_sigterm: the training loader's place in epoch 1 cannot be carried from 3 ranks to 2 "
                      r"\(DataLoader has no state_dict.*\): the epoch starts over", resumed.log("rank0"))
    assert len(said) == 1, why
    assert "cannot be carried" not in resumed.log("rank1"), why
    epoch = DistributedSampler(range(scenario.samples), num_replicas=2, rank=0, seed=7)  # Lightning's (seed_everything)
    epoch.set_epoch(1)
    first = samples(resumed)[0][step].split()  # rank 0's first batch after the stop: the epoch's first on 2 ranks
    assert first == [str(step), "1", *map(str, list(epoch)[:4])], why


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


@pytest.mark.extended  # which loaders have no position: tests/unit/lightning/test_trainer_stop.py
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


# -- Fabric: docs/fabric.md's loop (tests/support/fabric_loop.py), the data's place kept by DataPosition ------------
FABRIC = replace(ELASTIC, shuffle="", train_loader="stateful", keep_weights=True)


def fabric_job(out: Path, scenario: Scenario, world_size: int, env: dict[str, str] | None = None) -> JobResult:
    return run_job(out, scenario, mode="independent", world_size=world_size, timeout=MUST_FINISH, env=env,
                   script=HERE / "fabric_loop.py")


def assert_fabric_stopped(result: JobResult, world_size: int) -> int:
    """Every rank of the Fabric loop stopped at one step with 143, and one checkpoint holds it; returns the step."""
    why = result.describe()
    assert not result.timed_out, why
    assert set(result.returncodes.values()) == {SIGTERM_EXIT}, why
    assert sorted(result.outcomes) == list(range(world_size)), why
    (step,) = {o["stopped_at"] for o in result.outcomes.values()}
    assert [path.name for path in result.out.glob("step-*.ckpt")] == [f"step-{step}.ckpt"], why
    return step


@pytest.mark.extended
def test_a_fabric_loop_with_fsdp2_resumes_exactly_on_the_same_ranks(tmp_path: Path) -> None:
    """Fabric's ModelParallelStrategy with FSDP2, a StatefulDataLoader with 2 workers over a shuffling
    DistributedSampler, its place kept by DataPosition and given back by ``ddp_sigterm.fabric.load`` (Fabric's
    own load of a sharded checkpoint puts the saved state in the object's place): stopped inside the second epoch
    (a folder of shards), resumed on the same 2 ranks, each rank trains an uninterrupted run's batches and ends with
    its shards of its weights."""
    scenario = replace(FABRIC, strategy="fsdp2", num_workers=2)
    straight = fabric_job(tmp_path / "straight", scenario, 2)
    assert set(straight.returncodes.values()) == {0}, straight.describe()
    stopped = fabric_job(tmp_path / "run", replace(scenario, inject="1:35:forward"), 2, env=ENV)
    step = assert_fabric_stopped(stopped, 2)
    assert 30 < step < 60, stopped.describe()
    assert (tmp_path / "run" / f"step-{step}.ckpt").is_dir(), "FSDP2's stop checkpoint is a folder of shards"
    resumed = fabric_job(tmp_path / "run", replace(scenario, resume=True), 2)
    assert set(resumed.returncodes.values()) == {0}, resumed.describe()
    assert samples(resumed) == samples(straight), resumed.describe()
    for rank in (0, 1):
        torch.testing.assert_close(weights(resumed, rank), weights(straight, rank), rtol=0, atol=0)


@pytest.mark.extended
@pytest.mark.parametrize(("before", "after", "num_workers", "strategy", "loader"), [
    (3, 2, 2, "fsdp2", "stateful"), (2, 3, 0, "", "plain")])
def test_a_fabric_loop_resumed_on_other_ranks_trains_the_rest_of_the_epoch_once(
        tmp_path: Path, before: int, after: int, num_workers: int, strategy: str, loader: str) -> None:
    """The same loop, stopped on ``before`` ranks and resumed on ``after`` (FSDP2's shards redistributed; a plain
    DataLoader too: DataPosition keeps the place itself): every sample of the stopped epoch once, but for the
    padding rank 0 names, the next epoch every sample once, exit 0."""
    scenario = replace(FABRIC, strategy=strategy, num_workers=num_workers, train_loader=loader)
    per_rank = scenario.samples // before // 4
    stopped = fabric_job(tmp_path, replace(scenario, inject=f"1:{per_rank + 5}:forward"), before, env=ENV)
    step = assert_fabric_stopped(stopped, before)
    resumed = fabric_job(tmp_path, replace(scenario, resume=True), after)
    why = resumed.describe()
    assert set(resumed.returncodes.values()) == {0}, why
    said = resumed.log("rank0")
    assert f"the job resumed on {after} data-parallel ranks where it stopped on {before}" in said, why
    ((left, over, padding),) = DEALT.findall(said)
    counts = trained(resumed, max(before, after))
    assert set(counts[1]) == set(range(scenario.samples)), f"samples never trained in the stopped epoch\n{why}"
    assert sum(counts[1].values()) - scenario.samples == int(padding), f"samples trained twice\n{why}"
    assert int(left) == scenario.samples - before * 4 * (step - per_rank), why
    assert counts[2] == Counter(range(scenario.samples)), why
