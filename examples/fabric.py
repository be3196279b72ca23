"""A Fabric loop with ddp_sigterm: one call gives the loop its stop coordinator.

    python examples/fabric.py --root runs/fabric      # 2 CPU ranks, Fabric's launcher
    kill -TERM <pid of any rank>                      # every rank stops at the same step, one checkpoint,
                                                      # exit 143
    python examples/fabric.py --root runs/fabric      # resumes from that step, finishes, exit 0

The checkpoint holds the data position too: ``DataPosition`` keeps the place in its epoch of torchdata's
``StatefulDataLoader`` (``pip install torchdata``), so the resumed run trains on the batch after the stop, in the
epoch's order, and ends with an uninterrupted run's weights; resumed on another number of ranks, it trains the rest
of the epoch, each sample once.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
import time

import lightning as L
import torch
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from ddp_sigterm import DataPosition
from ddp_sigterm.fabric import load, save_at_stop, unison_stop


def newest_checkpoint(root: str) -> str | None:
    steps = [int(m.group(1)) for name in os.listdir(root) if (m := re.fullmatch(r"step-(\d+)\.ckpt", name))]
    return os.path.join(root, f"step-{max(steps)}.ckpt") if steps else None


def loader(rank: int, world_size: int) -> StatefulDataLoader:
    """This rank's shard of the data, shuffled by epoch (4 batches of 32 per rank and epoch with 2 ranks); its
    ``state_dict`` is its position in the epoch."""
    generator = torch.Generator().manual_seed(1234)
    data = TensorDataset(torch.randn(256, 16, generator=generator), torch.randn(256, 1, generator=generator))
    return StatefulDataLoader(data, batch_size=32, sampler=DistributedSampler(data, world_size, rank, seed=0))


def digest(model: torch.nn.Module) -> str:
    """A fingerprint of the weights: a resumed run must end with an uninterrupted run's."""
    return hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="runs/fabric", help="checkpoints go here")
    parser.add_argument("--devices", type=int, default=2, help="ranks per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    args = parser.parse_args()

    fabric = L.Fabric(accelerator="cpu", strategy="ddp", devices=args.devices, num_nodes=args.num_nodes)
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    # Fabric's DistributedSampler would not be in the state: the loader gets its own, not set up by Fabric
    data = DataPosition(loader(fabric.global_rank, fabric.world_size))  # the loader's place in its epoch
    state = {"model": model, "optimizer": optimizer, "step": 0, "epoch": 0, "data": data}
    os.makedirs(args.root, exist_ok=True)
    if (path := newest_checkpoint(args.root)) is not None:
        load(fabric, path, state)  # fabric.load, and the data's place given back (with a sharded strategy too)
    stop = unison_stop(fabric)  # every rank, same point: stop signals are recorded from here on
    rank, start = fabric.global_rank, state["step"]
    print(f"[rank {rank}] pid {os.getpid()}, starting at step {start}", flush=True)

    def save_and_exit(step: int) -> None:
        path = os.path.join(args.root, f"step-{step}.ckpt")
        save_at_stop(fabric, path, state)  # fabric.save on every rank; a failure anywhere raises everywhere
        name = signal.Signals(stop.decision.signum).name
        print(f"[rank {rank}] stopped at step {step} by {name}, checkpoint {path}, exit {stop.exit_code}", flush=True)
        raise SystemExit(stop.exit_code)

    step = start
    try:
        while step < args.max_steps:
            for x, y in data.epoch(state["epoch"]):  # the sampler told the epoch; after a resume, the rest of it
                time.sleep(args.step_seconds)  # stands in for real work
                x, y = fabric.to_device((x, y))
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                fabric.backward(loss)
                optimizer.step()
                step = state["step"] = step + 1
                print(f"[rank {rank}] step {step}", flush=True)
                if stop.should_stop(step):  # every rank, every step: the same answer everywhere
                    save_and_exit(step)
                if step == args.max_steps:
                    break
            else:
                state["epoch"] += 1
        if stop.decide_now(step):  # a signal after the last agreement is not lost
            save_and_exit(step)
        print(f"[rank {rank}] finished at step {step}, weights {digest(model)}", flush=True)
    finally:
        stop.close()


if __name__ == "__main__":
    main()
