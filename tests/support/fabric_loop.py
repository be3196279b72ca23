"""docs/fabric.md's loop: Fabric, the package's ``unison_stop`` and ``save_at_stop``, the training data's place kept
by :class:`ddp_sigterm.DataPosition`; DDP, or ModelParallelStrategy with FSDP2's ``fully_shard``
(``Scenario.strategy="fsdp2"``: the stop checkpoint is a folder of shards).

Launched by the harness like the Lightning scenario (a :class:`scenario.Job`, one process per rank:
``mode="independent"``), on as many ranks as the launch has: it reads ``max_epochs``, ``samples``,
``train_loader`` (``plain`` or ``stateful``), ``num_workers``, ``step_sleep``, ``inject``, ``record_samples``,
``keep_weights``, ``resume`` (from the newest ``step-<N>.ckpt`` in the job's directory). Each rank writes
``outcome.rank<R>.json``, and with ``record_samples`` appends ``<step> <epoch> <index> ...`` per step to
``samples.rank<R>``.
"""

from __future__ import annotations

import json
import os
import re
import time

import lightning as L
import torch
from ddp_sigterm_tests.scenario import Job
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddp_sigterm import DataPosition
from ddp_sigterm.fabric import load, save_at_stop, unison_stop

JOB = Job.read()
SCENARIO = JOB.scenario
OUT = JOB.out
INJECT = SCENARIO.injections()  # "rank:batch:forward": before that step's forward


class Numbers(Dataset):
    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x, self.y = torch.randn(n, 16, generator=generator), torch.randn(n, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """FSDP2 over the data-parallel ranks: every layer with weights, then the whole."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


def newest_checkpoint() -> str | None:
    steps = [int(m.group(1)) for name in os.listdir(OUT) if (m := re.fullmatch(r"step-(\d+)\.ckpt", name))]
    return os.path.join(OUT, f"step-{max(steps)}.ckpt") if steps else None


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    strategy = L.fabric.strategies.ModelParallelStrategy(shard, data_parallel_size=world, tensor_parallel_size=1) \
        if SCENARIO.strategy == "fsdp2" else "ddp"
    fabric = L.Fabric(accelerator="cpu", devices=1, num_nodes=world, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(7)
    rank = fabric.global_rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05))
    data = Numbers(SCENARIO.samples)
    kind = DataLoader
    if SCENARIO.train_loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        kind = StatefulDataLoader
    loader = kind(data, batch_size=4, sampler=DistributedSampler(data, world, rank, seed=7),
                  num_workers=SCENARIO.num_workers, persistent_workers=SCENARIO.num_workers > 0)
    position = DataPosition(loader)
    state = {"model": model, "optimizer": optimizer, "step": 0, "epoch": 0, "data": position}
    if SCENARIO.resume and (path := newest_checkpoint()) is not None:
        load(fabric, path, state)
    stop = unison_stop(fabric)
    outcome = {"rank": rank, "world_size": world, "exit_code": 0, "stopped_at": None, "injected_at": None}
    step = state["step"]

    def stop_here() -> None:
        save_at_stop(fabric, os.path.join(OUT, f"step-{step}.ckpt"), state)
        outcome.update(stopped_at=step, exit_code=stop.exit_code)
        raise SystemExit(stop.exit_code)

    try:
        while state["epoch"] < SCENARIO.max_epochs:
            for x, y, index in position.epoch(state["epoch"]):
                for injected in INJECT:
                    if injected.matches(rank, step + 1, "forward") and outcome["injected_at"] is None:
                        outcome["injected_at"] = time.monotonic()
                        os.kill(os.getpid(), injected.signum)
                time.sleep(SCENARIO.step_sleep)
                if SCENARIO.record_samples:
                    with open(os.path.join(OUT, f"samples.rank{rank}"), "a") as samples:
                        samples.write(f"{step} {state['epoch']} {' '.join(str(int(i)) for i in index)}\n")
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                fabric.backward(loss)
                optimizer.step()
                step = state["step"] = step + 1
                if stop.should_stop(step):
                    stop_here()
            state["epoch"] += 1
        if stop.decide_now(step):
            stop_here()
    finally:
        outcome.update(step=step)
        with open(os.path.join(OUT, f"outcome.rank{rank}.json"), "w") as file:
            json.dump(outcome, file)
        if SCENARIO.keep_weights:
            local = {name: (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().cpu()
                     for name, tensor in model.state_dict().items()}
            torch.save(local, os.path.join(OUT, f"weights.rank{rank}.pt"))
        stop.close()


if __name__ == "__main__":
    main()
