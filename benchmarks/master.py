"""make bench-master: the pull requests' cost table, with the script attached to PR 1.

Runs patches/lightning-master/01-sigterm-every-rank/benchmark.py (``torchrun --nproc-per-node=R``, ``--step-ms S``) in
three of make test-upstream's trees, each with its venv: Lightning's master as it is (#20825's broadcast at every
batch), master with the series' base alone (#21666 and #21665: no check, the floor; its two halves run the same code,
so its figure is the noise of the method) and master with the base and the pull requests. Every cell of the table
(step time x ranks x training only or a validation of 5 batches every 10 steps) runs each tree REPS times, the trees
taking turns; a cell shows the median over the jobs of the per-step cost of the check (each job's mean step with it
against its mean step without it, in percent), and the range over the jobs.

    python benchmarks/master.py [--reps 3] [--step-ms 1 10 100] [--ranks 2 4] [--validate-every 0 10]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
from pathlib import Path

from ddp_sigterm_tests.harness import free_port, supervise

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = ROOT / "patches" / "lightning-master" / "01-sigterm-every-rank" / "benchmark.py"
SIDES = {
    "master (#20825)": ROOT / ".venv-upstream",
    "master + #21666 + #21665 (floor)": ROOT / ".venv-upstream-base",
    "master + #21666 + #21665 + PR 1": ROOT / ".venv-upstream-patched",
}
RUN_TIMEOUT = 600


def run_once(venv: Path, step_ms: float, ranks: int, validate_every: int) -> float:
    """One job of the attached benchmark; the check's cost in percent of a step without it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [str(venv / "bin" / "torchrun"), f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", str(SCRIPT), f"--step-ms={step_ms:g}",
               f"--validate-every={validate_every}"]
    job = supervise(Path(tempfile.mkdtemp(prefix="bench-master-")), {"torchrun": (command, env)}, RUN_TIMEOUT)
    output, code = job.output(), job.returncodes["torchrun"]
    found = re.search(r"^lightning .*ms/step, ([+-][0-9.]+)%$", output, re.MULTILINE)
    if found is None:
        raise SystemExit(f"benchmark run failed ({venv}, exit {code}):\n{output[-3000:]}")
    # the measurement is printed at the end of training: an abort at exit (Gloo's, on master) does not change it
    after = "" if code == 0 else f" (then torchrun exited {code})"
    print(f"{venv.name}, {step_ms:g} ms, {ranks} ranks, validate every {validate_every}: {found.group(0)}{after}",
          flush=True)
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--step-ms", type=float, nargs="+", default=[1, 10, 100])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--validate-every", type=int, nargs="+", default=[0, 10], help="0: training only")
    args = parser.parse_args()
    cells = [(step_ms, ranks, every) for every in args.validate_every for ranks in args.ranks
             for step_ms in args.step_ms]
    costs: dict[tuple[float, int, int, str], list[float]] = {}
    for _ in range(args.reps):
        for step_ms, ranks, every in cells:
            for name, venv in SIDES.items():
                costs.setdefault((step_ms, ranks, every, name), []).append(run_once(venv, step_ms, ranks, every))
    print(f"\nper-step cost of the SIGTERM check, median of {args.reps} jobs (range), CPU ranks (Gloo):\n")
    print("| step | ranks | validation | " + " | ".join(SIDES) + " |")
    print("|---|---|---|" + "---|" * len(SIDES))
    for step_ms, ranks, every in cells:
        shown = []
        for name in SIDES:
            values = costs[(step_ms, ranks, every, name)]
            shown.append(f"{statistics.median(values):+.1f}% ({min(values):+.1f} to {max(values):+.1f})")
        validation = f"every {every} steps" if every else "none"
        print(f"| {step_ms:g} ms | {ranks} | {validation} | " + " | ".join(shown) + " |")


if __name__ == "__main__":
    main()
