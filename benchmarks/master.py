"""make bench-master: the pull requests' benchmark figure, with the script attached to PR 1.

Runs patches/lightning-master/01-sigterm-every-rank/benchmark.py (``torchrun --nproc-per-node=2``) REPS times in
Lightning's master as it is (#20825's broadcast at every batch) and in master with the pull requests, alternating,
in make test-upstream's venvs, and prints each run's line and the median per-step cost of the check in each.

    python benchmarks/master.py [--reps 10]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from harness import free_port, supervise  # noqa: E402

SCRIPT = ROOT / "patches" / "lightning-master" / "01-sigterm-every-rank" / "benchmark.py"
SIDES = {"master (#20825)": ROOT / ".venv-upstream", "master + PRs": ROOT / ".venv-upstream-patched"}
RUN_TIMEOUT = 300


def run_once(venv: Path) -> float:
    """One run of the attached benchmark; the check's cost in percent of a step without it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [str(venv / "bin" / "torchrun"), "--nproc-per-node=2", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", str(SCRIPT)]
    job = supervise(Path(tempfile.mkdtemp(prefix="bench-master-")), {"torchrun": (command, env)}, RUN_TIMEOUT)
    output, code = job.output(), job.returncodes["torchrun"]
    found = re.search(r"^lightning .*ms/step, ([+-][0-9.]+)%$", output, re.MULTILINE)
    if found is None:
        raise SystemExit(f"benchmark run failed ({venv}, exit {code}):\n{output[-3000:]}")
    # the measurement is printed at the end of training: an abort at exit (Gloo's, on master) does not change it
    after = "" if code == 0 else f" (then torchrun exited {code})"
    print(f"{venv.name}: {found.group(0)}{after}", flush=True)
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    costs: dict[str, list[float]] = {name: [] for name in SIDES}
    for _ in range(args.reps):
        for name, venv in SIDES.items():
            costs[name].append(run_once(venv))
    for name, values in costs.items():
        print(f"{name}: {statistics.median(values):+.1f}% per step (median of {len(values)} runs; "
              f"{', '.join(f'{v:+.1f}' for v in values)})")


if __name__ == "__main__":
    main()
