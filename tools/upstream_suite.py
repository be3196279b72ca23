"""Run Lightning's own tests against two set-ups of Lightning and compare them, test by test.

``make test-lightning`` (``package``): Lightning's release tests (the release sdist has none: they come from an
archive of Lightning's repository: tools/fetch_upstream.sh), run twice in this project's environment: stock
(``DDP_SIGTERM=0``, the package switched off) and with the package active, as a user who installed it runs
Lightning. A test whose outcome differs fails the comparison, unless it is listed as an accepted difference,
with the reason (docs/how-it-works.md lists them too); the accepted differences must show (they prove the
package was active). Exits 1 on any other difference, a missing accepted one, or a run that did not finish.

    python tools/upstream_suite.py package --archive $LIGHTNING_SOURCES/lightning-2.6.5-tests.tar.gz --into build \\
        tests_pytorch/trainer/connectors/test_signal_connector.py ...

(``package`` may be left out: the first form of this script had no sub-command.)

``make test-upstream`` (``prepare``, then ``trees``): Lightning's ``master`` snapshot, unpacked by ``prepare`` as three
git repositories (the snapshot's commit tagged ``snapshot``): ``master`` as it is, ``master-base`` with the open
upstream pull requests the series is stacked on (its ``base`` file: #21666, #21665; one commit each, tagged ``base``),
and ``master-patched`` with those and the pull requests of patches/lightning-master/ applied by ``git am``. The first
and the last are installed editable in a venv each, neither with ddp_sigterm (``trees`` checks it); ``master-base`` is
the floor of make bench-master. ``trees`` runs the selected tests from each tree's ``tests/`` folder with that tree's
venv, plus every test file the series adds or changes, then the standalone tests of those files one pytest process each
(``PL_RUN_STANDALONE_TESTS=1``, as Lightning's CI runs them), and fails on: a run that did not finish, a test that
passed (or was skipped) unpatched and fails or errors patched, a new test that fails, a test that disappears (unless the
series or its base deleted its file); differences the series does not fix yet can be listed in PENDING, with the reason.
Tests failing in both trees are notes (this machine's environment).

    python tools/upstream_suite.py prepare --archive $LIGHTNING_SOURCES/lightning-master-7f0c3436cd.tar.gz \\
        --series patches/lightning-master --open-prs $LIGHTNING_SOURCES/open-prs --into build/upstream
    python tools/upstream_suite.py trees --series patches/lightning-master --out build/upstream/results \\
        --unpatched build/upstream/master .venv-upstream/bin/python \\
        --patched build/upstream/master-patched .venv-upstream-patched/bin/python tests_pytorch/loops ...
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import IO

# test id -> why it differs with the package installed (and must: the difference is the package's purpose)
ACCEPTED = {
    "tests_pytorch/trainer/connectors/test_callback_connector.py::test_checkpoint_callbacks_are_last":
        "compares trainer.callbacks with an exact list: the entry point adds UnisonStop to every Trainer",
    "tests_pytorch/trainer/connectors/test_callback_connector.py::test_attach_model_callbacks":
        "compares trainer.callbacks with an exact list: the entry point adds UnisonStop to every Trainer",
}
# make test-upstream: test id -> why the patched tree still ends it worse than master does (the series does not fix
# it yet). Printed as "pending", never fails the comparison. Keep it empty but while a fix is on its way.
PENDING: dict[str, str] = {}
PER_TEST_TIMEOUT = 120  # seconds, pytest-timeout; the whole run has its own bound below
RUN_TIMEOUT = 1200
# Lightning's standalone tests (``RunIf(standalone=True)``: a DDP test relaunches the pytest command for its other
# ranks, so the command must select that one test) run one per pytest process, with Lightning's 90 s per-test bound;
# a hang in a collective is not interrupted by pytest-timeout's signal, so the process group has a hard bound too
STANDALONE_TEST_TIMEOUT, STANDALONE_RUN_TIMEOUT = 90, 150
# the trees of make test-upstream, under --into: the snapshot, the snapshot with the open upstream pull requests the
# series is stacked on (its `base` file; the floor of make bench-master), and with the series on top of those
UNPATCHED, BASE, PATCHED = "master", "master-base", "master-patched"
SNAPSHOT_TAG, BASE_TAG = "snapshot", "base"
GIT_IDENTITY = ["-c", "user.name=Lightning snapshot", "-c", "user.email=snapshot@invalid",
                "-c", "safe.directory=*", "-c", "commit.gpgsign=false", "-c", "init.defaultBranch=master"]
SNAPSHOT_DATE = "2026-07-20T00:00:00+00:00"
# written by the editable install (setup.py) or needed by it, not part of the snapshot: kept out of `git status`
SETUP_FILES = ["README.md", "requirements/base.txt", "src/*/version.info", "src/*.egg-info/", "build/"]
FAILING = ("failed", "error")


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    outcomes: dict[str, str]  # test id -> passed / failed / error / skipped
    log: Path
    returncode: int
    finished: bool  # pytest wrote its report: it was not killed or cut short
    seconds: float = 0.0  # wall time of the pytest run

    def count(self, outcome: str) -> int:
        return sum(1 for value in self.outcomes.values() if value == outcome)

    def summary(self, every_count: bool = False) -> str:
        """"<name>: N tests, a passed, ..." (``every_count``: passed, failed, skipped even when 0, and the time)."""
        shown = [o for o in ("passed", "failed", "error", "skipped")
                 if self.count(o) or (every_count and o != "error")]
        counts = ", ".join(f"{self.count(o)} {o}" for o in shown)
        if not self.finished:
            return (f"{self.name}: pytest ended with exit code {self.returncode} before writing its report "
                    f"(log: {self.log})")
        seconds = f" ({self.seconds:.0f} s)" if every_count else ""
        return f"{self.name}: {len(self.outcomes)} tests, {counts}{seconds}"


def extract(tar: tarfile.TarFile, into: Path) -> Path:
    """Unpack ``tar`` (one top folder, as Lightning's archives have) under ``into``; its top folder there."""
    into.mkdir(parents=True, exist_ok=True)
    tar.extractall(into, filter="data")
    return into / tar.getnames()[0].split("/")[0]


def unpack(archive: Path, into: Path) -> Path:
    """The archive's ``tests/`` folder under ``into`` (unpacked once)."""
    with tarfile.open(archive) as tar:
        tests = into / tar.getnames()[0].split("/")[0] / "tests"
        if not tests.is_dir():
            extract(tar, into)
    return tests


def run(name: str, tests: Path, files: list[str], env: dict[str, str], out: Path,
        python: str = sys.executable, options: tuple[str, ...] = ()) -> Run:
    """Run pytest with ``python`` on ``files`` from Lightning's ``tests/`` folder, as Lightning's CI does, with
    ``env`` deciding the package's switch (any other DDP_SIGTERM_* setting of the caller is left out). pytest runs
    in a session of its own, killed whole when it is done or out of time (no stray DDP or DataLoader process)."""
    report, log = (out / f"{name}.xml").resolve(), (out / f"{name}.log").resolve()
    command = [python, "-m", "pytest", "-p", "no:cacheprovider", "--color=no", "-q",
               f"--timeout={PER_TEST_TIMEOUT}", f"--junitxml={report}", *options, *files]
    report.unlink(missing_ok=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DDP_SIGTERM")}
    start = time.monotonic()
    with open(log, "w") as output:
        returncode = supervised(command, tests, {**environ, "OMP_NUM_THREADS": "1", **env}, output, RUN_TIMEOUT)
    seconds = time.monotonic() - start
    finished = report.exists()
    return Run(name, read_junit(report, tests) if finished else {}, log, returncode, finished, seconds)


def supervised(command: list[str], cwd: Path, env: dict[str, str], output: IO[str], timeout: float) -> int:
    """Run ``command`` in a session of its own, its output to ``output``; kill the whole session when it is done or
    after ``timeout`` seconds (no stray DDP or DataLoader process). Its exit code, -1 when out of time."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        output.write(f"\nupstream_suite: not finished within {timeout} s\n")
        return -1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def read_junit(report: Path, tests: Path) -> dict[str, str]:
    """test id ("<file relative to tests/>::[Class::]name") -> outcome."""
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):  # noqa: S314 - pytest's own report, written here
        parts = case.get("classname", "").split(".")
        if parts[0] == tests.name:  # junit names modules from the rootdir, the archive's top folder
            parts = parts[1:]
        # the module is the longest prefix that is a file; what follows is a test class
        cut = next((i for i in range(len(parts), 0, -1) if (tests / Path(*parts[:i])).with_suffix(".py").is_file()),
                   len(parts))
        test_id = "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], case.get("name", "")])
        kinds = {child.tag for child in case}
        outcome = "error" if "error" in kinds else "failed" if "failure" in kinds else \
            "skipped" if "skipped" in kinds else "passed"
        # a test can fail in its call and error in its teardown: keep the worst
        if outcomes.get(test_id) not in FAILING:
            outcomes[test_id] = outcome
    return outcomes


def differences(stock: Run, ours: Run) -> dict[str, tuple[str | None, str | None]]:
    ids = set(stock.outcomes) | set(ours.outcomes)
    return {i: (stock.outcomes.get(i), ours.outcomes.get(i)) for i in sorted(ids)
            if stock.outcomes.get(i) != ours.outcomes.get(i)}


def unfinished(*runs: Run) -> bool:
    failed = False
    for run_ in runs:
        if not run_.finished or not run_.outcomes:
            print(f"error: the {run_.name} run did not finish or collected no test (log: {run_.log})")
            failed = True
    return failed


def compare_package(args: argparse.Namespace) -> int:
    """make test-lightning: stock Lightning against Lightning with the package, in this Python's environment."""
    tests = unpack(args.archive, args.into)
    out = args.into / "test-lightning"
    out.mkdir(parents=True, exist_ok=True)
    stock = run("stock", tests, args.files, {"DDP_SIGTERM": "0"}, out)
    ours = run("with-ddp_sigterm", tests, args.files, {"DDP_SIGTERM": "1"}, out)
    print(stock.summary())
    print(ours.summary())
    failed = unfinished(stock, ours)
    found = differences(stock, ours)
    for test_id, (before, after) in found.items():
        reason = ACCEPTED.get(test_id)
        if reason is not None and before == "passed" and after == "failed":
            print(f"accepted: {test_id}: {before} -> {after} ({reason})")
        else:
            print(f"DIFFERENCE: {test_id}: stock {before}, with ddp_sigterm {after} (log: {ours.log})")
            failed = True
    for test_id in ACCEPTED:
        if found.get(test_id) != ("passed", "failed"):
            print(f"error: the accepted difference {test_id} did not show (stock {stock.outcomes.get(test_id)}, "
                  f"with ddp_sigterm {ours.outcomes.get(test_id)}): was the package active?")
            failed = True
    for test_id, outcome in stock.outcomes.items():
        if outcome in FAILING and ours.outcomes.get(test_id) == outcome:
            print(f"note: {test_id} {outcome} in both runs (log: {stock.log})")
    print("test-lightning: " + ("FAILED" if failed else "passed: no difference but the accepted ones"))
    return 1 if failed else 0


# --- make test-upstream ----------------------------------------------------------------------------------------

def series_lines(path: Path) -> list[str]:
    """The names in a quilt-like series file: one a line, blank lines and ``#`` comments left out."""
    names = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [name for name in names if name]


def read_series(series: Path) -> list[tuple[str, list[Path]]]:
    """The pull requests of ``series`` (a directory) in order, each with its patches in order; [] when there is
    no series file or it names nothing. Exits on a series that names a missing directory or file."""
    top = series / "series"
    if not top.is_file() or not series_lines(top):
        return []
    pulls = []
    for name in series_lines(top):
        folder = series / name
        if not (folder / "series").is_file():
            sys.exit(f"error: {top} names {name}, but {folder}/series does not exist")
        patches = [(folder / patch).resolve() for patch in series_lines(folder / "series")]  # git am runs in the tree
        missing = [str(patch) for patch in patches if not patch.is_file()]
        if missing or not patches:
            sys.exit(f"error: {folder}/series names no patch or a missing one: {', '.join(missing) or 'empty'}")
        if not (folder / "DESCRIPTION.md").is_file():
            print(f"warning: {folder} has no DESCRIPTION.md (the pull request's text)")
        pulls.append((name, patches))
    return pulls


def read_base(series: Path, open_prs: Path | None) -> list[Path]:
    """The diffs of the open upstream pull requests the series is stacked on, in order: the names in ``series/base``,
    files of ``open_prs`` ($LIGHTNING_SOURCES/open-prs). [] without a base file; exits on a missing diff."""
    names = series_lines(series / "base") if (series / "base").is_file() else []
    if names and open_prs is None:
        sys.exit(f"error: {series}/base names {', '.join(names)}: give their folder with --open-prs")
    diffs = [(open_prs / name).resolve() for name in names] if open_prs is not None else []
    missing = [str(diff) for diff in diffs if not diff.is_file()]
    if missing:
        sys.exit(f"error: {series}/base names missing diffs: {', '.join(missing)}")
    return diffs


def announce_series(series: Path, pulls: list[tuple[str, list[Path]]]) -> None:
    if not pulls:
        print(f"*** no series: {series}/series does not exist or names nothing ***\n"
              f"*** no series: patched == unpatched ***")


def git(tree: Path, *command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *GIT_IDENTITY, *command], cwd=tree, env={**os.environ, **(env or {})}, text=True,
                          capture_output=True, check=False, timeout=300)


def checked(done: subprocess.CompletedProcess[str], what: str) -> None:
    if done.returncode != 0:
        sys.exit(f"error: {what} failed:\n{done.stdout}{done.stderr}")


def prepare(args: argparse.Namespace) -> int:
    """Unpack the snapshot into --into/master, --into/master-base and --into/master-patched (recreated every time: a
    few seconds), each a git repository whose first commit, tagged "snapshot", is the snapshot; apply the series' base
    (open upstream pull requests, one commit each, tagged "base") to the last two, and the series to the last with
    git am."""
    start = time.monotonic()
    pulls = read_series(args.series)
    announce_series(args.series, pulls)
    base = read_base(args.series, args.open_prs)
    args.into.mkdir(parents=True, exist_ok=True)
    date = {"GIT_AUTHOR_DATE": SNAPSHOT_DATE, "GIT_COMMITTER_DATE": SNAPSHOT_DATE}
    for name in (UNPATCHED, BASE, PATCHED):
        tree = args.into / name
        shutil.rmtree(tree, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=args.into) as scratch, tarfile.open(args.archive) as tar:
            extract(tar, Path(scratch)).rename(tree)
        checked(git(tree, "init", "-q"), f"git init in {tree}")
        checked(git(tree, "add", "-A"), f"git add in {tree}")
        checked(git(tree, "commit", "-q", "-m", f"Lightning master snapshot ({args.archive.name})", env=date),
                f"git commit in {tree}")
        checked(git(tree, "tag", SNAPSHOT_TAG), f"git tag in {tree}")
        # setup.py reads ./README.md (not in the snapshot) and writes version and requirement files into the tree
        (tree / "README.md").write_text("# Lightning (master snapshot, for make test-upstream)\n")
        with open(tree / ".git" / "info" / "exclude", "a") as exclude:
            exclude.write("".join(f"/{pattern}\n" for pattern in SETUP_FILES))
        for diff in base if name != UNPATCHED else []:
            # their CHANGELOG hunks are written against a newer CHANGELOG than the snapshot's
            checked(git(tree, "apply", "--exclude=*CHANGELOG.md", str(diff)), f"applying {diff.name} to {tree}")
            checked(git(tree, "add", "-A"), f"git add in {tree}")
            message = f"{diff.stem}: open upstream pull request, as it stood (CHANGELOG hunks left out)"
            checked(git(tree, "commit", "-q", "-m", message, env=date), f"git commit in {tree}")
            print(f"applied {diff.name} to {tree} (the series' base)")
        checked(git(tree, "tag", BASE_TAG), f"git tag in {tree}")
    tree = args.into / PATCHED
    for name, patches in pulls:
        done = git(tree, "am", "--quiet", "--committer-date-is-author-date", *map(str, patches))
        if done.returncode != 0:
            print(done.stdout + done.stderr, file=sys.stderr)
            git(tree, "am", "--abort")
            sys.exit(f"error: the series' pull request {name} does not apply to the snapshot and its base with git am "
                     f"(the failing patch and file are named above)")
        print(f"applied {name}: {len(patches)} patch(es)")
    head = git(tree, "log", "--oneline", f"{BASE_TAG}..HEAD").stdout.strip()
    print(f"build trees: {args.into / UNPATCHED} (snapshot), {args.into / BASE} (snapshot + {len(base)} base pull "
          f"request(s)), {tree} (and {len(head.splitlines())} commit(s) of the series) in "
          f"{time.monotonic() - start:.1f} s")
    return 0


PREFLIGHT = """
import importlib.metadata, importlib.util, pathlib, sys
import lightning, lightning.fabric, lightning.pytorch
src = pathlib.Path(sys.argv[1]).resolve() / "src"
found = [str(getattr(m, "__file__", m)) for m in (lightning, lightning.fabric, lightning.pytorch)
         if src not in pathlib.Path(m.__file__).resolve().parents]
assert not found, f"Lightning is not imported from {src}: {found}"
assert importlib.util.find_spec("ddp_sigterm") is None, "ddp_sigterm is importable in this venv"
dists = [d.metadata["Name"] for d in importlib.metadata.distributions() if "ddp" in (d.metadata["Name"] or "").lower()]
assert not dists, f"ddp_sigterm is installed in this venv: {dists}"
hooks = [e.value for d in importlib.metadata.distributions() for e in d.entry_points
         if e.group.endswith("callbacks_factory")]
assert not hooks, f"callbacks_factory entry points in this venv: {hooks}"
print(lightning.__version__)
"""


def preflight(python: str, tree: Path) -> str:
    """The Lightning version ``python`` imports, once checked that it comes from ``tree`` and nothing in that
    environment is ddp_sigterm (its entry point would change Lightning's behaviour)."""
    done = subprocess.run([python, "-c", PREFLIGHT, str(tree)], capture_output=True, text=True, timeout=300,
                          check=False, cwd=tempfile.gettempdir(), env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        sys.exit(f"error: {python} is not a venv of {tree} alone:\n{done.stdout}{done.stderr}".strip())
    return done.stdout.strip()


def files_deleted(tree: Path, since: str, until: str) -> set[str]:
    """The test files (relative to tests/) deleted between two commits of ``tree``."""
    done = git(tree, "diff", "--name-only", "--diff-filter=D", since, until, "--", "tests")
    checked(done, f"git diff in {tree}")
    return {str(Path(name).relative_to("tests")) for name in done.stdout.split()}


def series_test_files(tree: Path) -> list[str]:
    """The test files (relative to tests/) the series adds or changes in ``tree``."""
    done = git(tree, "diff", "--name-only", "--diff-filter=AM", SNAPSHOT_TAG, "HEAD", "--", "tests")
    checked(done, f"git diff in {tree}")
    files = [Path(name).relative_to("tests") for name in done.stdout.split()]
    return [str(name) for name in files if name.name.startswith("test_") and name.suffix == ".py"]


def present(selection: list[str], tests: Path, name: str) -> list[str]:
    """The part of ``selection`` (files, folders, node ids) that exists in ``tests``: pytest stops on a missing one."""
    kept = [item for item in selection if (tests / item.split("::")[0]).exists()]
    for item in selection:
        if item not in kept:
            print(f"{name}: {item} is not in this tree: left out")
    return kept


def standalone_tests(tests: Path, files: list[str], python: str) -> list[str]:
    """The ids of the standalone tests (``RunIf(standalone=True)``) in ``files``, as pytest collects them."""
    if not files:  # pytest would collect the whole folder
        return []
    done = subprocess.run([python, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", *files], cwd=tests,
                          env={**os.environ, "PL_RUN_STANDALONE_TESTS": "1"}, capture_output=True, text=True,
                          timeout=300, check=False)
    ids = [line.removeprefix(f"{tests.name}/") for line in done.stdout.splitlines() if "::" in line]
    if done.returncode not in (0, 5):  # 5: nothing collected
        sys.exit(f"error: collecting the standalone tests of {' '.join(files)} failed:\n{done.stdout}{done.stderr}")
    return ids


def run_standalone(name: str, tests: Path, files: list[str], out: Path, python: str) -> dict[str, str]:
    """Run each standalone test of ``files`` in a pytest process of its own with ``PL_RUN_STANDALONE_TESTS=1``, as
    Lightning's CI does; test id -> outcome. Every rank prints to one log, and the ranks' junit reports would overwrite
    each other: the outcome is rank 0's exit code (Lightning's launcher kills rank 0 when another rank fails) and its
    summary line. A test still running after ``STANDALONE_RUN_TIMEOUT`` fails, its processes killed."""
    outcomes = {}
    for number, test_id in enumerate(standalone_tests(tests, files, python)):
        log = (out / f"{name}-standalone-{number}.log").resolve()
        command = [python, "-m", "pytest", "-p", "no:cacheprovider", "--color=no", "-q",
                   f"--timeout={STANDALONE_TEST_TIMEOUT}", test_id]
        with open(log, "w") as output:
            output.write(f"{test_id}\n")
            output.flush()
            environ = {**os.environ, "OMP_NUM_THREADS": "1", "PL_RUN_STANDALONE_TESTS": "1"}
            returncode = supervised(command, tests, environ, output, STANDALONE_RUN_TIMEOUT)
        summary = log.read_text(errors="replace").splitlines()[-1:]
        outcomes[test_id] = "failed" if returncode != 0 else "skipped" if "skipped" in "".join(summary) else "passed"
        print(f"{name}, standalone: {test_id} {outcomes[test_id]} (exit code {returncode}; log: {log})")
    return outcomes


def reruns(run_: Run) -> list[str]:
    """The tests pytest-rerunfailures reran (the "RERUN <id>" lines of -rR)."""
    lines = run_.log.read_text(errors="replace").splitlines() if run_.log.exists() else []
    return [line.split(" ", 1)[1].removeprefix("tests/") for line in lines if line.startswith("RERUN ")]


def compare_trees(args: argparse.Namespace) -> int:
    """make test-upstream: the snapshot against the snapshot with the series, each tree in its own venv."""
    (unpatched_tree, unpatched_python), (patched_tree, patched_python) = args.unpatched, args.patched
    unpatched_tree, patched_tree = Path(unpatched_tree).resolve(), Path(patched_tree).resolve()
    # absolute, not resolved: a venv's python is a link to the base interpreter
    unpatched_python, patched_python = str(Path(unpatched_python).absolute()), str(Path(patched_python).absolute())
    pulls = read_series(args.series)
    announce_series(args.series, pulls)
    versions = [preflight(unpatched_python, unpatched_tree), preflight(patched_python, patched_tree)]
    print(f"lightning {versions[0]} from {unpatched_tree}, {versions[1]} from {patched_tree}; no ddp_sigterm in "
          f"either venv")
    covered = [Path(item) for item in args.files if "::" not in item]  # folders and whole files selected
    series_files = series_test_files(patched_tree)
    added = [name for name in series_files
             if not any(Path(name) == item or item in Path(name).parents for item in covered)]
    if added:
        print(f"test files the series adds or changes, run too: {' '.join(added)}")
    selection = [*args.files, *added]
    args.out.mkdir(parents=True, exist_ok=True)
    sides = (("unpatched", unpatched_tree, unpatched_python), ("patched", patched_tree, patched_python))

    def run_side(name: str, tree: Path, python: str) -> Run:
        # -rR: pytest-rerunfailures names the tests it reran (the junit report does not)
        return run(name, tree / "tests", present(selection, tree / "tests", name), {}, args.out, python=python,
                   options=("-rR",))

    # The two trees at once: each pytest keeps about one of the machine's cores busy. A test that passed unpatched and
    # failed patched is run again below, in both trees, one after the other, before it counts.
    with concurrent.futures.ThreadPoolExecutor(len(sides)) as pool:
        runs = list(pool.map(run_side, *zip(*sides)))
    # the series' standalone tests, skipped in the runs above, one by one in each tree that has them
    runs = [dataclasses.replace(run_, outcomes={**run_.outcomes, **run_standalone(
        run_.name, tree / "tests", present(series_files, tree / "tests", run_.name), args.out, python)})
        for run_, (_, tree, python) in zip(runs, sides)]
    unpatched, patched = runs
    print(unpatched.summary(every_count=True))
    print(patched.summary(every_count=True))
    failed = unfinished(unpatched, patched)
    base_removed = files_deleted(patched_tree, SNAPSHOT_TAG, BASE_TAG)
    suspects: dict[str, str] = {}  # test id -> what the first runs showed: run again before calling it a regression
    for test_id, (before, after) in differences(unpatched, patched).items():
        pending = PENDING.get(test_id)
        if after is None and test_id.split("::")[0] in base_removed:
            print(f"removed by the series' base (an open upstream pull request): {test_id} (was {before})")
            continue
        if after is None and not (patched_tree / "tests" / test_id.split("::")[0]).is_file():
            print(f"removed by the series: {test_id} (was {before})")
            continue
        if before is None:
            worse, verdict = after in FAILING, f"{test_id}: new in the patched tree, {after}"
            shown = "NEW AND FAILING: " if worse else ""
        elif after is None and (variants := parametrized(test_id, patched.outcomes)):
            # the series parametrized the test (its description says why): its cases must not fail
            worse = any(v in FAILING for v in variants.values())
            cases = ", ".join(f"{k[len(test_id):]} {v}" for k, v in sorted(variants.items()))
            verdict, shown = f"{test_id}: {before} unpatched, parametrized patched: {cases}", "changed by the series: "
        elif after is None:
            worse, verdict, shown = True, f"{test_id}: {before} unpatched, not run patched", "DISAPPEARED: "
        else:
            worse = after in FAILING and before not in FAILING
            verdict = f"{test_id}: unpatched {before}, patched {after}"
            shown = "REGRESSION: " if worse else "fixed by the series: " if before in FAILING and after == "passed" \
                else "changed: "
        if not worse:
            print(shown + verdict)
        elif pending is not None:
            print(f"pending: {verdict} ({pending})")
        elif shown == "REGRESSION: ":
            suspects[test_id] = verdict
        else:
            print(f"{shown}{verdict} (log: {patched.log})")
            failed = True
    if suspects:
        # a test that fails now and then on this machine (a spawn test's gloo abort, say) must not fail the target, and
        # a real regression fails again: run the differing tests once more in both trees, and judge those runs
        print(f"running the {len(suspects)} test(s) that passed unpatched and failed patched again, in both trees")
        again = [run(f"{name}-again", tree / "tests", list(suspects), {}, args.out, python=python, options=("-rR",))
                 for name, tree, python in sides]
        failed = unfinished(*again) or failed
        for test_id, verdict in suspects.items():
            before, after = again[0].outcomes.get(test_id), again[1].outcomes.get(test_id)
            if after in FAILING and before not in FAILING:
                print(f"REGRESSION: {verdict}; again: unpatched {before}, patched {after} (log: {again[1].log})")
                failed = True
            else:
                print(f"note: {verdict}, but not again (unpatched {before}, patched {after}): flaky here, not counted "
                      f"(logs: {patched.log}, {again[1].log})")
    for test_id, reason in PENDING.items():
        if unpatched.outcomes.get(test_id) == patched.outcomes.get(test_id):
            print(f"note: pending {test_id} ends alike in both trees now: take it out of PENDING ({reason})")
    for test_id, outcome in unpatched.outcomes.items():
        if outcome in FAILING and patched.outcomes.get(test_id) in FAILING:
            print(f"note: {test_id} {outcome} in both runs (log: {unpatched.log})")
    for run_ in runs:
        rerun = reruns(run_)
        for test_id in sorted(set(rerun)):
            print(f"note: {test_id} was rerun {rerun.count(test_id)}x in the {run_.name} run (@pytest.mark.flaky, as "
                  f"in Lightning's CI; log: {run_.log})")
    if not pulls:
        print("no series: patched == unpatched")
    print("test-upstream: " + ("FAILED" if failed else "passed: the series breaks no test of master"))
    return 1 if failed else 0


def parametrized(test_id: str, outcomes: dict[str, str]) -> dict[str, str]:
    """The outcomes of ``test_id``'s parametrized cases, ``test_id[...]``."""
    return {case: outcome for case, outcome in outcomes.items() if case.startswith(test_id + "[")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    package = commands.add_parser("package", help="make test-lightning: stock against the package, one environment")
    package.add_argument("--archive", type=Path, required=True, help="Lightning's tests, as in $LIGHTNING_SOURCES")
    package.add_argument("--into", type=Path, default=Path("build"), help="where to unpack it")
    package.add_argument("files", nargs="+", help="test files or folders, relative to the archive's tests/")
    package.set_defaults(main=compare_package)
    trees = commands.add_parser("prepare", help="make test-upstream: the unpatched and the patched tree")
    trees.add_argument("--archive", type=Path, required=True, help="Lightning's master snapshot (.tar.gz)")
    trees.add_argument("--series", type=Path, required=True, help="the series folder (patches/lightning-master)")
    trees.add_argument("--open-prs", type=Path,
                       help="the diffs the series' base file names ($LIGHTNING_SOURCES/open-prs)")
    trees.add_argument("--into", type=Path, default=Path("build/upstream"), help="where the trees go")
    trees.set_defaults(main=prepare)
    compare = commands.add_parser("trees", help="make test-upstream: the two trees' tests, each in its venv")
    compare.add_argument("--unpatched", nargs=2, required=True, metavar=("TREE", "PYTHON"))
    compare.add_argument("--patched", nargs=2, required=True, metavar=("TREE", "PYTHON"))
    compare.add_argument("--series", type=Path, required=True, help="the series folder, for the report")
    compare.add_argument("--out", type=Path, default=Path("build/upstream/results"), help="logs and junit reports")
    compare.add_argument("files", nargs="+", help="test files, folders or node ids, relative to the trees' tests/")
    compare.set_defaults(main=compare_trees)
    argv = sys.argv[1:]
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["package", *argv]  # the first form of this script: make test-lightning's comparison
    args = parser.parse_args(argv)
    return args.main(args)


if __name__ == "__main__":
    sys.exit(main())
