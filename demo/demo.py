"""The demo: 2 CPU ranks started independently (as srun or one pod per rank would), SIGTERM to rank 1
at batch 2, a table of what each rank saw, a relaunch that resumes to the end, then stock Lightning
in the same situation (the package switched off with DDP_SIGTERM=0), cut off by a timeout.

Run with ``make demo``. It uses the same harness and training script as the test suite.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from ddp_sigterm_tests.harness import JobResult, run_job
from ddp_sigterm_tests.scenario import Scenario

ROOT = Path(__file__).resolve().parent.parent

OUT = ROOT / "demo-output"
STOCK_TIMEOUT = 25.0


def table(title: str, result: JobResult) -> None:
    print(f"\n{title}  ({result.elapsed:.1f} s{', CUT OFF BY TIMEOUT' if result.timed_out else ''})")
    print(f"{'rank':>4}  {'signal received':<16} {'batches run':>11} {'final step':>10} {'exit code':>9}  outcome")
    for rank in range(result.world_size):
        outcome = result.outcomes.get(rank)
        code = result.returncodes.get(f"rank{rank}")
        code_text = "killed" if code is None else str(code)
        if outcome is None:
            print(f"{rank:>4}  {'?':<16} {'-':>11} {'-':>10} {code_text:>9}  hung: no outcome written")
            continue
        stop = outcome["stop"] or {}
        received = "yes (injected)" if outcome["injected_at"] else ("yes" if stop.get("received_at") else "no")
        print(f"{rank:>4}  {received:<16} {outcome['batches_started']:>11} {outcome['global_step']:>10} "
              f"{code_text:>9}  {outcome['exception'] or 'finished'}")
    ckpts = result.checkpoints()
    print("checkpoint: " + (", ".join(f"{p.name}" for p in ckpts) if ckpts else "none"))


def main() -> int:
    shutil.rmtree(OUT, ignore_errors=True)
    scenario = Scenario(inject="1:2:forward", max_steps=12)
    started = time.monotonic()

    stopped = run_job(OUT / "with-ddp_sigterm", scenario, timeout=120)
    table("1. ddp_sigterm installed: SIGTERM to rank 1 at batch 2", stopped)
    resumed = run_job(OUT / "with-ddp_sigterm", Scenario(resume=True, max_steps=12), timeout=120)
    table("2. same script relaunched with ckpt_path='hpc': resumes and finishes", resumed)

    stock = run_job(OUT / "stock", scenario, timeout=STOCK_TIMEOUT, env={"DDP_SIGTERM": "0"})
    table(f"3. stock Lightning (DDP_SIGTERM=0), same signal; cut off after {STOCK_TIMEOUT:.0f} s", stock)
    print(f"\nlogs and checkpoints in {OUT}; total {time.monotonic() - started:.0f} s")

    ok = (
        {o["global_step"] for o in stopped.outcomes.values()} == {stopped.outcomes[0]["global_step"]}
        and set(stopped.returncodes.values()) == {143}
        and set(resumed.returncodes.values()) == {0}
    )
    print("\nddp_sigterm: every rank stopped at the same step, exited 143, resumed to the end."
          if ok else "\nUNEXPECTED: see the logs above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
