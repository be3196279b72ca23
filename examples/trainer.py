"""A Lightning Trainer script that never mentions ddp_sigterm: installing the package is enough.

    python examples/trainer.py --root runs/trainer          # 2 CPU ranks, Lightning's launcher
    kill -TERM <pid of any rank>                            # every rank stops at the same step,
                                                            # hpc_ckpt_<N>.ckpt is saved, exit 143
    python examples/trainer.py --root runs/trainer          # resumes from step N, finishes, exit 0

A resume gives back more than the weights: the data position (torchdata's ``StatefulDataLoader``, ``pip install
torchdata``: the batch after the stop) and the logger's run (``<root>/lightning_logs/version_0/metrics.csv`` goes on).

Under torchrun or srun, pass ``--devices``/``--num-nodes`` as for any Lightning script. With a Lightning that stops
every rank at the same step by itself (the patched build, without ddp_sigterm), pass
``--on-exception-checkpoint``: Lightning's ``OnExceptionCheckpoint`` then saves the stop
(``<root>/on_exception.ckpt``), and the next run resumes from it.
"""

from __future__ import annotations

import argparse
import glob
import os
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader  # torch's DataLoader, with a position a checkpoint keeps


class Regression(pl.LightningModule):
    def __init__(self, step_seconds: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)
        self.step_seconds = step_seconds

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_seconds)  # stands in for real work
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Progress(pl.Callback):
    """One line per optimizer step and rank; and what ended the run."""

    def on_train_start(self, trainer, pl_module):
        print(f"[rank {trainer.global_rank}] pid {os.getpid()}, starting at step {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        print(f"[rank {trainer.global_rank}] step {trainer.global_step}", flush=True)

    def on_train_end(self, trainer, pl_module):
        print(f"[rank {trainer.global_rank}] finished at step {trainer.global_step}", flush=True)

    def on_exception(self, trainer, pl_module, exception):
        print(f"[rank {trainer.global_rank}] stopped at step {trainer.global_step}: {exception!r}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="runs/trainer", help="checkpoints go here")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--on-exception-checkpoint", action="store_true",
                        help="save the stop with Lightning's OnExceptionCheckpoint (a Lightning without ddp_sigterm)")
    args = parser.parse_args()

    pl.seed_everything(0)
    data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
    stop_checkpoint = [OnExceptionCheckpoint(args.root)] if args.on_exception_checkpoint else []
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=args.devices, num_nodes=args.num_nodes,
                         max_steps=args.max_steps, default_root_dir=args.root, callbacks=[Progress(), *stop_checkpoint],
                         logger=CSVLogger(args.root), log_every_n_steps=10,
                         enable_checkpointing=args.on_exception_checkpoint, enable_progress_bar=False,
                         enable_model_summary=False)
    # A stop saves <root>/hpc_ckpt_<N>.ckpt; "hpc" resumes from the newest one.
    resume = "hpc" if glob.glob(os.path.join(args.root, "hpc_ckpt_*.ckpt")) else None
    if args.on_exception_checkpoint and os.path.exists(os.path.join(args.root, "on_exception.ckpt")):
        resume = os.path.join(args.root, "on_exception.ckpt")
    trainer.fit(Regression(args.step_seconds), StatefulDataLoader(data, batch_size=32), ckpt_path=resume)


if __name__ == "__main__":
    main()
