"""The grace period a stop needs, against the checkpoint's size: ``make bench-grace``.

Two "pods" (one process per rank, tests/test_kubernetes.py's supervisor), drained at batch 3 with a
SIGTERM to each pod's main process; the time from that SIGTERM until every pod has exited is what
``terminationGracePeriodSeconds`` (or SLURM's ``KillWait``/``GraceTime``) must cover. The checkpoint is
made larger with ``Scenario.payload_mb`` (a buffer of the model). Local disk, and with ``--s3`` a moto
S3 server on 127.0.0.1 too (in memory: an upper bound on what the protocol costs, not a network's speed).
Writes a Markdown table to stdout (docs/kubernetes.md holds the last one).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import tempfile
from pathlib import Path

from ddp_sigterm_tests.harness import OutsideSignal, run_job, s3_server
from ddp_sigterm_tests.scenario import Scenario

ROOT = Path(__file__).resolve().parent.parent

SAVED = re.compile(r"the stop checkpoint of step \d+ is saved: .* \(([\d.]+) s, every rank\)")


def drained(out: Path, payload_mb: int, env: dict[str, str]) -> tuple[float, float, int]:
    """(seconds from SIGTERM to every pod gone, seconds the save took on rank 0, checkpoint MiB)."""
    term = OutsideSignal(rank=0, batch=3, targets="pods")
    result = run_job(out, Scenario(payload_mb=payload_mb, max_steps=50), mode="independent", timeout=600,
                     outside=[term], env=env)
    if result.timed_out or set(result.returncodes.values()) != {143} or term.sent_at is None:
        raise RuntimeError(f"the drained job did not stop cleanly:\n{result.describe()}")
    needed = max(result.exited_at.values()) - term.sent_at
    save = float(SAVED.search(result.log("rank0")).group(1))
    size = sum(p.stat().st_size for p in out.glob("hpc_ckpt_*.ckpt")) / 2**20
    return needed, save, round(size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0,64,256,1024", help="extra MiB in the checkpoint, comma-separated")
    parser.add_argument("--s3", action="store_true", help="also to a moto S3 server on 127.0.0.1")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print("| storage | checkpoint | save (rank 0) | SIGTERM → every pod gone |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        stores: list[tuple[str, dict[str, str]]] = [("local disk", {})]
        with contextlib.ExitStack() as stack:
            if args.s3:
                env = stack.enter_context(s3_server(work, "bench"))
                stores.append(("S3 (moto, 127.0.0.1)", {**env, "DDP_SIGTERM_CHECKPOINT_DIR": "s3://bench/run"}))
            for store, env in stores:
                for index, size in enumerate(sizes):
                    out = work / f"{store.split()[0]}-{index}"
                    needed, save, mib = drained(out, size, {**env, "DDP_SIGTERM_STOP_DEADLINE": "300"})
                    shown = f"{mib} MiB" if store == "local disk" else f"{size} MiB + weights"
                    shown = "< 1 MiB" if shown.startswith("0 MiB") else shown
                    print(f"| {store} | {shown} | {save:.2f} s | {needed:.2f} s |", flush=True)


if __name__ == "__main__":
    main()
