"""Randomized fault soak: N real jobs, each stopped by a random fault, then resumed.

Each run draws: 2 or 3 ranks; a launch mode (independent, Lightning's launcher, torchrun, SLURM's
variables); who is signalled (one rank, some ranks at different batches and phases, or every process
of the job from outside, DataLoader workers included); the batch; the phase (batch start, forward,
backward, optimizer step, validation, or a second signal while the stop checkpoint is being saved).
Under SLURM the signal is SIGTERM or the requeue signal, SIGUSR1 (a stub ``scontrol`` records the
requeue). Every run must end with every rank at the same stop step, the right exit code and one
checkpoint that holds that step (and, for SIGUSR1, exactly one requeue); the resumed run must then
finish exactly the remaining steps, exit 0.

    python tools/soak.py N [--seed S] [--record docs/reliability.md]

Exits non-zero if any run failed; each failure's description (outcomes, log tails) is printed and
kept under build/soak/. The draws of run i depend only on (seed, i), so a failure can be replayed
with ``--only i``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import platform
import random
import shutil
import signal
import sys
import time
from pathlib import Path

# the tests' job runner, checks and faults: a soak run is a scenario test's job, drawn at random
from ddp_sigterm_tests.harness import OutsideSignal, run_job, scontrol_calls, stub_scontrol
from ddp_sigterm_tests.helpers import MUST_FINISH, assert_finished, assert_unison_stop
from ddp_sigterm_tests.injection import Injection, encode, parse
from ddp_sigterm_tests.scenario import Scenario

ROOT = Path(__file__).resolve().parent.parent
MAX_STEPS = 24
VAL_EVERY = 6  # validation after every 6th training batch: phases in validation come up early
PHASES = ("batch_start", "forward", "backward", "optimizer", "validation", "save")
MODES = ("independent", "lightning", "torchrun", "slurm")
SECTION = ("<!-- soak: written by tools/soak.py --record -->", "<!-- /soak -->")


@dataclasses.dataclass
class Draw:
    run: int
    mode: str
    world_size: int
    who: str  # "one", "some", "all"
    inject: list[Injection]
    outside: tuple[int, int] | None  # (rank whose progress triggers it, batch) for "all"
    workers: int
    signal: str = "SIGTERM"  # under SLURM, sometimes its requeue signal

    def describe(self) -> str:
        where = ";".join(filter(None, [f"outside at rank {self.outside[0]} batch {self.outside[1]}"
                                       if self.outside else "", encode(self.inject)]))
        return (f"run {self.run}: {self.mode}, {self.world_size} ranks, {self.workers} workers, "
                f"{self.signal} to {self.who}: {where}")


def draw(seed: int, run: int) -> Draw:
    rng = random.Random(f"{seed}:{run}")
    mode = rng.choice(MODES)
    world_size = rng.choice((2, 3))
    who = rng.choice(("one", "some", "all"))
    workers = rng.choice((0, 0, 2)) if who != "all" else rng.choice((0, 2))
    entries: list[tuple[int, int | None, str]] = []  # rank, batch (None: any), phase
    outside = None
    if who == "all":
        outside = (rng.randrange(world_size), rng.randint(1, 10))
        if rng.random() < 0.3:  # and a second signal to one rank while the checkpoint is saved
            entries.append((rng.randrange(world_size), None, "save"))
    else:
        ranks = [rng.randrange(world_size)] if who == "one" else rng.sample(range(world_size), 2)
        for rank in ranks:
            entries.extend(_entries(rng, rank))
    name = rng.choice(("SIGTERM", "SIGUSR1")) if mode == "slurm" else "SIGTERM"
    return Draw(run, mode, world_size, who, [Injection(*entry, name) for entry in entries], outside, workers, name)


def _entries(rng: random.Random, rank: int) -> list[tuple[int, int | None, str]]:
    phase = rng.choice(PHASES)
    if phase == "validation":  # batch = the validation batch, in the first validation round
        return [(rank, rng.randint(1, 4), "validation")]
    if phase == "save":  # the first signal somewhere, a second one during the stop checkpoint's save
        return [(rank, rng.randint(1, 10), "forward"), (rank, None, "save")]
    return [(rank, rng.randint(1, 10), phase)]


def run_one(d: Draw, out: Path) -> tuple[bool, str, dict]:
    scenario = Scenario(max_steps=MAX_STEPS, batches=MAX_STEPS, val_every=VAL_EVERY, num_workers=d.workers)
    signum = signal.Signals[d.signal]
    outside = OutsideSignal(rank=d.outside[0], batch=d.outside[1], targets="all", signum=signum) if d.outside else None
    env = stub_scontrol(out) if d.mode == "slurm" else {}
    facts: dict = {"returncodes": None, "elapsed": 0.0}
    try:
        stopped = run_job(out, dataclasses.replace(scenario, inject=encode(d.inject)), mode=d.mode,
                          world_size=d.world_size, timeout=MUST_FINISH, outside=outside, env=env)
        facts.update(returncodes=stopped.returncodes, elapsed=round(stopped.elapsed, 1))
        step = assert_unison_stop(stopped, exit_code=128 + signum)
        facts["step"] = step
        if d.mode == "slurm":  # the requeue signal requeues, once; SIGTERM asks whether SLURM preempts the job
            recorded = scontrol_calls(env)
            expected = ["requeue 4242"] if signum == signal.SIGUSR1 else ["show job --oneliner 4242"]
            assert recorded == expected, f"scontrol calls {recorded}, expected {expected}\n{stopped.describe()}"
        resumed = run_job(out, dataclasses.replace(scenario, resume=True), mode=d.mode, world_size=d.world_size,
                          timeout=MUST_FINISH)
        assert_finished(resumed, steps=MAX_STEPS)
        started = {o["batches_started"] for o in resumed.outcomes.values()}
        # a stop inside a validation round resumes at the next training batch: same count
        assert started == {MAX_STEPS - step}, f"resumed run started {started} batches\n{resumed.describe()}"
        facts["elapsed"] += round(resumed.elapsed, 1)
    except Exception as failure:
        return False, f"{type(failure).__name__}: {failure}", facts
    return True, "", facts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("n", type=int)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--only", type=int, help="replay run ONLY of --seed")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "soak")
    parser.add_argument("--record", type=Path, help="write the summary page (docs/reliability.md)")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    runs = [args.only] if args.only is not None else range(args.n)
    started, failures, rows = time.monotonic(), [], []
    for run in runs:
        d = draw(args.seed, run)
        ok, why, facts = run_one(d, args.out / f"run{run}")
        rows.append({**dataclasses.asdict(d), "inject": encode(d.inject), "ok": ok, **facts})
        print(f"{'ok  ' if ok else 'FAIL'} {d.describe()} -> step {facts.get('step')}, "
              f"{facts['returncodes']}, {facts['elapsed']} s", flush=True)
        if ok:
            shutil.rmtree(args.out / f"run{run}", ignore_errors=True)
        else:
            failures.append(run)
            print(why, flush=True)
    minutes = (time.monotonic() - started) / 60
    (args.out / "results.jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    print(f"soak: {len(rows)} runs, {len(failures)} failed {failures}, seed {args.seed}, {minutes:.1f} min")
    if args.record:  # the soak's section of the page; the rest of it is written by hand
        page = args.record.read_text()
        start, end = page.index(SECTION[0]), page.index(SECTION[1]) + len(SECTION[1])
        args.record.write_text(page[:start] + SECTION[0] + "\n" + _section(rows, failures, args.seed, minutes)
                               + SECTION[1] + page[end:])
    return 1 if failures else 0


def _section(rows: list[dict], failures: list[int], seed: int, minutes: float) -> str:
    def count(key: str) -> str:
        values: dict = {}
        for row in rows:
            values[row[key]] = values.get(row[key], 0) + 1
        return ", ".join(f"{k}: {v}" for k, v in sorted(values.items(), key=str))

    phases: dict[str, int] = {}
    for row in rows:
        for phase in sorted({injected.phase for injected in parse(row["inject"])}):
            phases[phase] = phases.get(phase, 0) + 1
    venv = Path(sys.prefix).name
    make = f"make soak N={len(rows)} SEED={seed}"
    if venv != ".venv":
        make += f" PYTHON={Path(sys._base_executable).name} VENV={venv}"  # its name: a path is one machine's
    phase_counts = ", ".join(f"{k}: {v}" for k, v in sorted(phases.items()))
    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in ("torch", "lightning"))
    return f"""Last recorded soak: `{make}`: **{len(rows)} runs, {len(failures)} failed**, \
{minutes:.0f} minutes on the 2-core machine; Python {platform.python_version()}, {versions}. \
CI runs `make soak N=6` with a new seed each time.

| drawn | runs |
|---|---|
| launch mode | {count("mode")} |
| ranks | {count("world_size")} |
| signal | {count("signal")} (SIGUSR1: SLURM's requeue signal; `scontrol requeue` called once) |
| signalled | {count("who")} ("all": every process from outside, DataLoader workers included) |
| DataLoader workers | {count("workers")} |
| phase of an injected signal | {phase_counts} ("save": a second signal while the stop checkpoint is written) |

Failures: {", ".join(f"run {r}" for r in failures) if failures else "none"}.
Replay one run: `{venv}/bin/python tools/soak.py 1 --seed {seed} --only <run>`.
"""


if __name__ == "__main__":
    sys.exit(main())
