"""make bench: what the SIGTERM check costs per step and how fast a stop happens, side by side.

Per-step cost: each job interleaves its modes block by block (see job.py), so every ratio to the
no-check baseline is measured inside one job; the environments (stock Lightning + the package, and
the patched Lightning when .venv-patched exists) take turns, repetition after repetition. Stop
latency: the environment's fix with its defaults, SIGTERM to rank 1. Agreement cost: the bare
all-reduce at 2, 4 and 8 ranks. The cloud notice watcher: pairs of jobs without and with it. Writes
docs/benchmarks.md and docs/benchmarks-overhead.png and prints one summary line per configuration.

    python benchmarks/bench.py [--reps 5] [--steps-ms 1,10,100] [--ranks 2,4] [--no-docs]
    python benchmarks/bench.py --parts notice --no-docs   # one part only, its summary lines
    python benchmarks/bench.py --from-results build/bench-results.json   # rewrite the page only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from ddp_sigterm_tests.harness import run_job

from ddp_sigterm._core.port import PAYLOAD_SIZE

ROOT = Path(__file__).resolve().parent.parent

STOCK_ENV = ROOT / ".venv" / "bin" / "python"  # released Lightning 2.6.6 with the package installed
PATCHED_ENV = ROOT / ".venv-patched" / "bin" / "python"
MAX_DELAY = 1.0  # the package's default, and the patch's constant
# The targets are read on 2 ranks: their cost points get more jobs (--target-reps), each TARGET_LONGER times as
# long, since the per-job ratios spread by a few points (a median of 5 short jobs is good to about +-1.5 points).
TARGET_RANKS = 2
TARGET_LONGER = 4
LABELS = {"nocheck": "no check", "stock": "stock 2.6.6", "package": "package", "patched": "patched 2.6.6"}


def environments() -> dict[str, tuple[Path, list[str]]]:
    envs = {"package": (STOCK_ENV, ["nocheck", "stock", "package"])}
    if PATCHED_ENV.exists():
        envs["patched"] = (PATCHED_ENV, ["nocheck", "patched"])
    return envs


def shape(step_ms: float, longer: int = 1) -> tuple[int, int]:
    """(block length, rounds) so that a job runs a few seconds whatever the step time; ``longer`` times
    the rounds for the configuration the targets are read on."""
    if step_ms <= 2:
        return 40, 8 * longer
    if step_ms <= 20:
        return 15, 6 * longer
    return 5, 4 * longer


def run(out: Path, python: Path, script: str, ranks: int, env: dict[str, str]):
    job = run_job(out, mode="independent", world_size=ranks, timeout=900, python=str(python),
                  script=ROOT / "benchmarks" / script, env=env, poll=0.01)
    prefix = "collective" if script == "collective.py" else "bench"
    results = {r: json.loads((out / f"{prefix}.rank{r}.json").read_text())
               for r in range(ranks) if (out / f"{prefix}.rank{r}.json").exists()}
    if job.timed_out or len(results) != ranks:
        raise SystemExit(f"benchmark job failed ({script}, {env}):\n{job.describe()}")
    return job, results


def heartbeat_share(cost: dict) -> float:
    """The heartbeat's cost in percent of training time: its thread's CPU time plus the main thread's waits."""
    return (cost["cpu_s"] + cost["waited_s"]) / cost["wall_s"] * 100


# -- per-step cost ----------------------------------------------------------------------------------
def measure_cost(step_ms: float, ranks: int, reps: int, longer: int = 1) -> dict[str, dict]:
    block, rounds = shape(step_ms, longer)
    per_mode: dict[str, dict[str, list[float]]] = {}
    heartbeats: dict[str, list[dict]] = {}
    for _ in range(reps):
        for name, (python, modes) in environments().items():
            steps = block * len(modes) * (rounds + 1)
            env = {"BENCH_KIND": "cost", "BENCH_STEP": str(step_ms / 1000), "BENCH_STEPS": str(steps),
                   "BENCH_BLOCK": str(block), "BENCH_MODES": ",".join(modes)}
            job, results = run(Path(tempfile.mkdtemp(prefix="bench-")), python, "job.py", ranks, env)
            if not all(r["durations"][m] for r in results.values() for m in modes):
                raise SystemExit(f"benchmark job timed no step in a mode ({name}, {env}):\n{job.describe()}")
            # a job's time per step in a mode: the median over its steps, then over its ranks
            ms = {m: statistics.median(statistics.median(r["durations"][m]) for r in results.values()) * 1000
                  for m in modes}
            for mode in modes:
                entry = per_mode.setdefault(mode, {"ms": [], "ratio": []})
                entry["ms"].append(ms[mode])
                entry["ratio"].append(ms[mode] / ms["nocheck"])
            # the rank on which the heartbeat cost the most
            heartbeats.setdefault(name, []).append(max((r["heartbeat"] for r in results.values()),
                                                       key=lambda h: h["cpu_s"] + h["waited_s"]))
    summary: dict[str, dict] = {}
    for mode, entry in per_mode.items():  # "nocheck" pools both environments' baselines
        summary[mode] = {"ms": statistics.median(entry["ms"]), "ratio": statistics.median(entry["ratio"]),
                         "ratios": entry["ratio"]}
    for name, costs in heartbeats.items():
        summary[name]["heartbeat"] = {key: statistics.median(h[key] for h in costs)
                                      for key in ("cpu_s", "waited_s", "wall_s")}
        hb = summary[name]["heartbeat"]
        print(f"heartbeat, {ranks} ranks, {step_ms:g} ms work: {LABELS[name]}: thread CPU {hb['cpu_s'] * 1000:.1f} ms, "
              f"main thread waited {hb['waited_s'] * 1000:.1f} ms, of {hb['wall_s']:.1f} s "
              f"({heartbeat_share(hb):.2f}%)", flush=True)
    return summary


# -- stop latency -------------------------------------------------------------------------------------
def measure_latency(step_ms: float, reps: int) -> dict[str, dict]:
    signal_batch = {1: 200, 10: 40}.get(int(step_ms), 12)  # late in the run
    steps = signal_batch + int(2 * MAX_DELAY * 1000 / step_ms) + 40
    found: dict[str, dict[str, list]] = {}
    for _ in range(reps):
        for name, (python, _) in environments().items():
            env = {"BENCH_KIND": "latency", "BENCH_STEP": str(step_ms / 1000), "BENCH_STEPS": str(steps),
                   "BENCH_SIGNAL_RANK": "1", "BENCH_SIGNAL_BATCH": str(signal_batch)}
            job, results = run(Path(tempfile.mkdtemp(prefix="bench-")), python, "job.py", 2, env)
            signalled = results[1]
            sent = signalled["sent_at"]
            row = found.setdefault(name, {"decided": [], "steps": [], "exception": [], "save": [], "exited": [],
                                          "codes": []})
            decision = signalled.get("decision")
            if decision is not None:
                row["decided"].append(decision["decided_at"] - sent)
                row["save"].append(signalled["exception_at"] - decision["decided_at"])
            row["steps"].append(signalled["stop_step"] - signal_batch)
            row["exception"].append(signalled["exception_at"] - sent)
            row["exited"].append(max(job.exited_at.values()) - sent)
            row["codes"].append(sorted(job.returncodes.values()))
    # medians; None where the fix records nothing (the patch has no decision record)
    return {name: {key: values if key == "codes" else (statistics.median(values) if values else None)
                   for key, values in row.items()} for name, row in found.items()}


# -- agreement cost versus world size ---------------------------------------------------------------
def measure_collective(world_sizes: list[int]) -> dict[int, dict[str, float]]:
    found = {}
    for world in world_sizes:
        _, results = run(Path(tempfile.mkdtemp(prefix="bench-")), STOCK_ENV, "collective.py", world,
                         {"BENCH_REPEATS": "500"})
        medians = [statistics.median(r["durations"]) for r in results.values()]
        p90s = [sorted(r["durations"])[int(0.9 * len(r["durations"]))] for r in results.values()]
        found[world] = {"median_ms": statistics.median(medians) * 1000, "p90_ms": statistics.median(p90s) * 1000}
        print(f"agreement all-reduce, {world} ranks{oversubscribed(world)}: median "
              f"{found[world]['median_ms']:.3f} ms, p90 {found[world]['p90_ms']:.3f} ms", flush=True)
    return found


def oversubscribed(ranks: int) -> str:
    cores = os.cpu_count() or 1
    return f" (oversubscribed: {cores} cores)" if ranks > cores else ""


# -- the cloud notice watcher ------------------------------------------------------------------------
NOTICE_STEP_MS = 10.0


def measure_notice(reps: int, ranks: int = TARGET_RANKS, step_ms: float = NOTICE_STEP_MS) -> dict[str, dict]:
    """The watcher off and on (AWS, its default period, a metadata service on 127.0.0.1 that never gives a notice),
    in pairs of jobs taking turns: it runs for the whole process, so one job's blocks cannot compare it. Per job,
    the package's time per step and its ratio to the job's own no-check blocks; with it on, the watch thread's CPU
    time (on the rank that polls) and the requests the service got."""
    from ddp_sigterm_tests.metadata_server import MetadataServer

    block, rounds = shape(step_ms, TARGET_LONGER)
    base = {"BENCH_KIND": "cost", "BENCH_STEP": str(step_ms / 1000), "BENCH_STEPS": str(block * 2 * (rounds + 1)),
            "BENCH_BLOCK": str(block), "BENCH_MODES": "nocheck,package"}
    found: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
    for _ in range(reps):
        for watch, row in found.items():
            with MetadataServer("aws") as service:
                env = {**base, **({"DDP_SIGTERM_NOTICE": "aws", "DDP_SIGTERM_NOTICE_URL": service.url}
                                  if watch == "on" else {})}
                job, results = run(Path(tempfile.mkdtemp(prefix="bench-")), STOCK_ENV, "job.py", ranks, env)
                requests = len(service.requests)
            ms = {m: statistics.median(statistics.median(r["durations"][m]) for r in results.values()) * 1000
                  for m in ("nocheck", "package")}
            row.setdefault("ms", []).append(ms["package"])
            row.setdefault("ratio", []).append(ms["package"] / ms["nocheck"])
            if watch == "on":
                polled = [r["heartbeat"] for r in results.values() if "notice_cpu_s" in r["heartbeat"]]
                if not polled or not requests:
                    raise SystemExit(f"the notice watcher did not poll ({env}):\n{job.describe()}")
                row.setdefault("pollers", []).append(len(polled))
                row.setdefault("cpu_s", []).append(max(h["notice_cpu_s"] for h in polled))
                row.setdefault("wall_s", []).append(max(h["wall_s"] for h in polled))
                row.setdefault("requests", []).append(requests)
    summary = {watch: {key: statistics.median(values) for key, values in row.items()} for watch, row in found.items()}
    summary["on"]["pairs"] = [on / off for on, off in zip(found["on"]["ms"], found["off"]["ms"])]
    on, off = summary["on"], summary["off"]
    print(f"notice watcher, {ranks} ranks, {step_ms:g} ms work: package {off['ms']:.3f} ms/step off, {on['ms']:.3f} "
          f"on ({(statistics.median(on['pairs']) - 1) * 100:+.1f}% per pair: "
          f"{', '.join(f'{(r - 1) * 100:+.1f}' for r in on['pairs'])}); watch thread CPU {on['cpu_s'] * 1000:.1f} ms "
          f"of {on['wall_s']:.1f} s ({on['cpu_s'] / on['wall_s'] * 100:.3f}%), {on['requests']:.0f} requests from "
          f"{on['pollers']:.0f} pollers",
          flush=True)
    return summary


# -- the page --------------------------------------------------------------------------------------------
def machine() -> str:
    model = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = ""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        kib = int(meminfo.read_text().split()[1])
        memory = f", {kib / 2**20:.0f} GiB"
    return f"{os.cpu_count()} cores ({model}){memory}, {platform.system()} {platform.release()}, Python " \
           f"{platform.python_version()}"


def plot(costs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = {"stock": "tab:red", "package": "tab:green", "patched": "tab:blue"}
    for ranks, by_step in costs.items():
        steps = sorted(by_step)
        for mode, color in colors.items():
            if mode in by_step[steps[0]]:
                ax.plot(steps, [(by_step[s][mode]["ratio"] - 1) * 100 for s in steps], marker="o", color=color,
                        linestyle="-" if ranks == 2 else "--",
                        label=f"{LABELS[mode]}, {ranks} ranks{oversubscribed(ranks)}")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("work per step (ms)")
    ax.set_ylabel("time per step vs no check (%)")
    ax.set_title("Per-step cost of the SIGTERM check (median of ratios, same job)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def page(args, costs, latencies, collective, started: datetime.datetime, seconds: float, command: str,
         notice: dict | None = None) -> str:
    lines = ["# Benchmarks", "",
             "What the SIGTERM check costs per training step, and how fast a stop happens, measured side by side",
             "with stock Lightning. Generated by `make bench`; do not edit by hand.", "",
             f"- Machine: {machine()}.",
             f"- Run: {started:%Y-%m-%d %H:%M} UTC, {seconds / 60:.0f} min. Command: `{command}` "
             "(`make bench` runs it without arguments).",
             "- Model: one `Linear(8, 1)`, batch 2, DDP on CPU with gloo; a step's work is a sleep of the stated",
             "  time, so the ranks do not compete for the cores; Lightning's own per-step overhead comes on top.",
             "", "## Per-step cost", "",
             "Each job runs its modes in turns, block by block (the same schedule on every rank), and compares",
             "them inside the job: the noise of this machine moves whole jobs by up to ±15%, which medians of",
             f"separate jobs cannot see through. {args.reps} jobs per environment and step time ({args.target_reps} "
             f"jobs {TARGET_LONGER} times as long at 2 ranks, where the targets are read), environments",
             "alternating; the table gives the median time per step and the median of the per-job ratios to",
             "*no check* (the released Lightning with its per-step broadcast removed and the package opted out).",
             "*patched* is compared with *no check* measured in the patched environment's own jobs.", ""]
    for ranks, by_step in costs.items():
        lines += [f"### {ranks} ranks{oversubscribed(ranks)}", "",
                  "| work per step | no check | stock 2.6.6 | package | patched 2.6.6 |", "|---|---|---|---|---|"]
        for step_ms in sorted(by_step):
            row = by_step[step_ms]
            cells = [f"{row['nocheck']['ms']:.2f} ms"]
            for mode in ("stock", "package", "patched"):
                cells.append(f"{row[mode]['ms']:.2f} ms ({(row[mode]['ratio'] - 1) * 100:+.1f}%)" if mode in row
                             else "—")
            lines.append(f"| {step_ms:g} ms | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["![overhead versus step time](benchmarks-overhead.png)", "",
              "Targets (package versus no check): at most +1% at 10 ms and 100 ms, +2% at 1 ms, 2 ranks:", ""]
    if 2 in costs:
        for step_ms in sorted(costs[2]):
            ratio = (costs[2][step_ms]["package"]["ratio"] - 1) * 100
            target = 2.0 if step_ms < 5 else 1.0
            lines.append(f"- {step_ms:g} ms: {ratio:+.1f}% — {'holds' if ratio <= target else 'MISSED'} "
                         f"(target +{target:g}%)")
    lines += ["", "**The heartbeat** (the thread that keeps the stop bound when steps become slower) runs through "
              "every block of a job, so the ratios above cannot show it. Measured directly instead, per job "
              "(median of the jobs; the rank where it cost most): the CPU time of its thread, and the time the main "
              "thread waited for a heartbeat's result at a step boundary, against the job's training time.", "",
              "| ranks | work per step | fix | thread CPU | main thread waited | of training time |",
              "|---|---|---|---|---|---|"]
    for ranks, by_step in costs.items():
        for step_ms in sorted(by_step):
            for name in ("package",):  # the patched build has no heartbeat: it votes at batch ends
                hb = by_step[step_ms].get(name, {}).get("heartbeat")
                if hb:
                    lines.append(f"| {ranks} | {step_ms:g} ms | {LABELS[name]} | {hb['cpu_s'] * 1000:.1f} ms | "
                                 f"{hb['waited_s'] * 1000:.1f} ms | {hb['wall_s']:.1f} s: "
                                 f"{heartbeat_share(hb):.2f}% |")
    if notice:
        on, off = notice["on"], notice["off"]
        lines += ["", "**The cloud notice watcher** (`notice=aws` at its default period, against a metadata service on "
                  "127.0.0.1 that never gives a notice: docs/cloud-notices.md) also runs for the whole process, so it "
                  f"is measured in pairs of jobs, without and with it, taking turns ({len(on['pairs'])} pairs, "
                  f"{TARGET_RANKS} ranks, {NOTICE_STEP_MS:g} ms of work per step; medians). Across jobs the noise is "
                  "the ±15% above; the watch thread's CPU time is measured directly, on the rank that polls (here each "
                  "rank is started as a node of its own, so each polls).", "",
                  "| watcher | package per step | vs its job's no-check blocks | watch thread CPU | requests |",
                  "|---|---|---|---|---|",
                  f"| off | {off['ms']:.2f} ms | {(off['ratio'] - 1) * 100:+.1f}% | — | — |",
                  f"| on | {on['ms']:.2f} ms ({(statistics.median(on['pairs']) - 1) * 100:+.1f}% per pair) | "
                  f"{(on['ratio'] - 1) * 100:+.1f}% | {on['cpu_s'] * 1000:.1f} ms of {on['wall_s']:.1f} s: "
                  f"{on['cpu_s'] / on['wall_s'] * 100:.3f}% | {on['requests']:.0f} per job, from "
                  f"{on['pollers']:.0f} pollers |"]
    lines += ["", NOTES["findings"], "## Stop latency", "",
              f"SIGTERM to rank 1 at the start of a training batch late in the run, "
              f"2 ranks, {args.reps} runs each, medians. *agreed*: signal to the agreed stop (package only: the "
              "patch keeps no decision record); *steps*: optimizer steps completed after the one the signal "
              "arrived in; *save*: agreement to the exception reaching the script (checkpoint save and barrier); "
              "*exception*: signal to the exception on the signalled rank; *all exited*: signal to the last "
              f"process gone (10 ms polling). Bound: max(two steps, max_delay = {MAX_DELAY:g} s).", "",
              "| work per step | fix | agreed | steps | save | exception | all exited | within bound | exit codes |",
              "|---|---|---|---|---|---|---|---|---|"]
    for step_ms in sorted(latencies):
        for name, row in latencies[step_ms].items():
            bound = max(2 * step_ms / 1000, MAX_DELAY)
            agreed = f"{row['decided'] * 1000:.0f} ms" if row["decided"] is not None else "—"
            save = f"{row['save'] * 1000:.0f} ms" if row["save"] is not None else "—"
            decided = row["decided"] if row["decided"] is not None else row["exception"]
            codes = sorted({tuple(c) for c in row["codes"]})
            lines.append(f"| {step_ms:g} ms | {name} | {agreed} | {row['steps']:.0f} | {save} | "
                         f"{row['exception'] * 1000:.0f} ms | {row['exited'] * 1000:.0f} ms | "
                         f"{'yes' if decided <= bound else 'NO'} | {', '.join(map(str, codes))} |")
    lines += ["", "## The agreement at scale", "",
              f"The agreement is one all-reduce of {PAYLOAD_SIZE} int64 on a gloo group. Measured alone (500 after a "
              "warm-up, per rank; median over ranks):", "", "| ranks | median | p90 |", "|---|---|---|"]
    for world, row in collective.items():
        lines.append(f"| {world}{oversubscribed(world)} | {row['median_ms']:.3f} ms | {row['p90_ms']:.3f} ms |")
    lines += ["", NOTES["scale"]]
    return "\n".join(lines) + "\n"


# Hand-written parts of the page: what the numbers mean and what was tried (findings), and the
# agreement at cluster scale (scale). Kept beside the script so that a re-run keeps them.
NOTES = {name: (Path(__file__).resolve().parent / f"{name}_notes.md").read_text() for name in ("findings", "scale")}


def load_results(path: Path) -> tuple[dict, dict, dict, dict | None]:
    """The measurements of an earlier run (JSON turns the numeric keys into strings)."""
    raw = json.loads(path.read_text())
    costs = {int(r): {float(s): v for s, v in by_step.items()} for r, by_step in raw["costs"].items()}
    latencies = {float(s): v for s, v in raw["latencies"].items()}
    collective = {int(w): v for w, v in raw["collective"].items()}
    return costs, latencies, collective, raw.get("notice")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--target-reps", type=int, default=10,
                        help=f"jobs per point, {TARGET_LONGER} times as long, at the 2-rank cost the targets use")
    parser.add_argument("--steps-ms", default="1,10,100")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--collective-ranks", default="2,4,8")
    parser.add_argument("--notice-reps", type=int, default=5, help="pairs of jobs for the notice watcher's cost")
    parser.add_argument("--parts", default="cost,latency,collective,notice",
                        help="what to measure (a page needs them all; --no-docs for fewer)")
    parser.add_argument("--no-docs", action="store_true", help="print the summary lines only")
    parser.add_argument("--from-results", type=Path, help="rewrite the page from an earlier run's JSON")
    args = parser.parse_args()
    if args.from_results:
        write_docs(args, *load_results(args.from_results), json.loads(args.from_results.read_text()))
        return
    parts = set(args.parts.split(","))
    if parts - {"cost", "latency", "collective", "notice"} or (not args.no_docs and len(parts) < 4):
        parser.error("--parts: cost, latency, collective and notice; the page needs all four (or --no-docs)")
    started, clock = datetime.datetime.now(datetime.timezone.utc), datetime.datetime.now().timestamp()
    step_times = [float(s) for s in args.steps_ms.split(",")]
    costs: dict[int, dict[float, dict]] = {}
    for ranks in [int(r) for r in args.ranks.split(",")] if "cost" in parts else []:
        for step_ms in step_times:
            if ranks == TARGET_RANKS:
                summary = measure_cost(step_ms, ranks, args.target_reps, longer=TARGET_LONGER)
            else:
                summary = measure_cost(step_ms, ranks, args.reps)
            costs.setdefault(ranks, {})[step_ms] = summary
            for mode, row in summary.items():
                print(f"cost, {ranks} ranks{oversubscribed(ranks)}, {step_ms:g} ms work: {LABELS[mode]:14s} "
                      f"{row['ms']:8.3f} ms/step, {(row['ratio'] - 1) * 100:+5.1f}% vs no check "
                      f"(per job: {', '.join(f'{(r - 1) * 100:+.1f}' for r in row['ratios'])})", flush=True)
    latencies = {}
    for step_ms in step_times if "latency" in parts else []:
        latencies[step_ms] = measure_latency(step_ms, args.reps)
        for name, row in latencies[step_ms].items():
            agreed = f"agreed {row['decided'] * 1000:.0f} ms, " if row["decided"] is not None else ""
            print(f"latency, 2 ranks, {step_ms:g} ms work, {name}: {agreed}{row['steps']:.0f} steps after, "
                  f"exception {row['exception'] * 1000:.0f} ms, all exited {row['exited'] * 1000:.0f} ms", flush=True)
    collective = measure_collective([int(r) for r in args.collective_ranks.split(",")]) if "collective" in parts else {}
    notice = measure_notice(args.notice_reps) if "notice" in parts else None
    command = " ".join(["python", "benchmarks/bench.py"] + sys.argv[1:])
    raw = {"costs": costs, "latencies": latencies, "collective": collective, "notice": notice,
           "started": started.isoformat(), "seconds": datetime.datetime.now().timestamp() - clock, "command": command}
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "bench-results.json").write_text(json.dumps(raw, indent=1, default=str))
    if not args.no_docs:
        write_docs(args, costs, latencies, collective, notice, raw)


def write_docs(args, costs: dict, latencies: dict, collective: dict, notice: dict | None, raw: dict) -> None:
    """The plot and the page, from the measurements and the run's record (start, duration, command)."""
    plot(costs, ROOT / "docs" / "benchmarks-overhead.png")
    started = datetime.datetime.fromisoformat(raw["started"])
    (ROOT / "docs" / "benchmarks.md").write_text(
        page(args, costs, latencies, collective, started, raw["seconds"], raw["command"], notice))
    print("wrote docs/benchmarks.md and docs/benchmarks-overhead.png")


if __name__ == "__main__":
    main()
