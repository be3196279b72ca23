"""Per-step cost of the SIGTERM check: no check, stock Lightning, the package, the patched Lightning.

Runs the configurations interleaved (one job each per repetition, in turn), so that the noise of a
busy 2-core machine hits them alike, and reports medians and ratios to the no-check baseline.

    python benchmarks/bench.py [--reps 5] [--ranks 2] [--steps-ms 1,10,100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from harness import run_job  # noqa: E402

JOB = ROOT / "benchmarks" / "job.py"
WARMUP = 20  # batches left out: data loader start, first agreements, cadence settling


def configurations() -> dict[str, tuple[str, dict[str, str]]]:
    stock_env = str(ROOT / ".venv" / "bin" / "python")
    configs = {
        "no check": (stock_env, {"DDP_SIGTERM": "0", "BENCH_NO_CHECK": "1"}),
        "stock 2.6.6": (stock_env, {"DDP_SIGTERM": "0"}),
        "package": (stock_env, {}),
    }
    patched = ROOT / ".venv-patched" / "bin" / "python"
    if patched.exists():
        configs["patched 2.6.6"] = (str(patched), {})
    return configs


def steps_for(step_ms: float) -> int:
    """Enough steps for a stable median without making the 100 ms runs long."""
    return max(60, min(400, int(6000 / step_ms)))


def per_step_ms(out: Path, ranks: int) -> float:
    """Median over ranks of (time from batch WARMUP to the last batch start) / batches."""
    times = []
    for rank in range(ranks):
        starts = json.loads((out / f"bench.rank{rank}.json").read_text())["starts"]
        times.append((starts[-1] - starts[WARMUP]) / (len(starts) - 1 - WARMUP) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps-ms", default="1,10,100")
    args = parser.parse_args()
    configs = configurations()
    results: dict[tuple[float, str], list[float]] = {}
    for step_ms in [float(s) for s in args.steps_ms.split(",")]:
        for rep in range(args.reps):
            for name, (python, env) in configs.items():
                out = Path(tempfile.mkdtemp(prefix="bench-"))
                job = run_job(out, mode="independent", world_size=args.ranks, timeout=600, python=python,
                              script=JOB, env={"BENCH_STEP": str(step_ms / 1000),
                                               "BENCH_STEPS": str(steps_for(step_ms)), **env})
                # the exit code is not judged here: gloo sometimes aborts at interpreter exit after
                # the results are written (issue 5); a missing result is a failure
                if job.timed_out or len(list(out.glob("bench.rank*.json"))) != args.ranks:
                    raise SystemExit(f"{name} at {step_ms} ms failed:\n{job.describe()}")
                results.setdefault((step_ms, name), []).append(per_step_ms(out, args.ranks))
        base = statistics.median(results[(step_ms, "no check")])
        for name in configs:
            median = statistics.median(results[(step_ms, name)])
            print(f"{args.ranks} ranks, {step_ms:g} ms step: {name:14s} {median:8.3f} ms/step "
                  f"[{', '.join(f'{v:.2f}' for v in results[(step_ms, name)])}] "
                  f"({(median / base - 1) * 100:+.1f}% vs no check, {args.reps} reps)", flush=True)


if __name__ == "__main__":
    main()
