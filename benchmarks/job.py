"""One rank of the benchmark job: a tiny DDP model whose step takes about BENCH_STEP seconds.

Started by benchmarks/bench.py (through the test harness) once per rank. Writes
``bench.rank<R>.json`` with the time of every training batch start, so the driver can compute the
per-step time after a warm-up. ``BENCH_NO_CHECK=1`` removes Lightning's per-step SIGTERM broadcast
for the run: with the package opted out that is the no-check baseline.
"""

from __future__ import annotations

import json
import os
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

ENV = os.environ
OUT = ENV["SCENARIO_OUT"]
STEP = float(ENV.get("BENCH_STEP", "0.01"))
STEPS = int(ENV.get("BENCH_STEPS", "200"))


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(STEP)  # the work of a step, without competing for the 2 cores
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        n = STEPS * 2 * self.trainer.world_size
        return DataLoader(TensorDataset(torch.randn(n, 8), torch.randn(n, 1)), batch_size=2)


class Clock(Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def setup(self, trainer, pl_module, stage):
        if ENV.get("BENCH_NO_CHECK") == "1" and hasattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor"):
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())


def main() -> None:
    clock = Clock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=int(ENV["SCENARIO_WORLD_SIZE"]),
        strategy="ddp",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[clock],
        default_root_dir=OUT,
    )
    trainer.fit(Tiny())
    with open(os.path.join(OUT, f"bench.rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"starts": clock.starts, "lightning": pl.__version__,
                   "callbacks": [type(cb).__name__ for cb in trainer.callbacks]}, f)


if __name__ == "__main__":
    main()
