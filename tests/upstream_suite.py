"""Run Lightning's own tests against two set-ups of Lightning and compare them, test by test.

``make test-lightning``: Lightning's release tests (the release sdist has none: they come from an archive of
Lightning's repository, see ../shared/upstream/README.md), run twice in this project's environment: stock
(``DDP_SIGTERM=0``, the package switched off) and with the package active, as a user who installed it runs
Lightning. A test whose outcome differs fails the comparison, unless it is listed as an accepted difference,
with the reason (docs/how-it-works.md lists them too); the accepted differences must show (they prove the
package was active). Exits 1 on any other difference, a missing accepted one, or a run that did not finish.

    python tests/upstream_suite.py --archive ../shared/upstream/lightning-2.6.5-tests.tar.gz --into build \\
        tests_pytorch/trainer/connectors/test_signal_connector.py ...
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

# test id -> why it differs with the package installed (and must: the difference is the package's purpose)
ACCEPTED = {
    "tests_pytorch/trainer/connectors/test_callback_connector.py::test_checkpoint_callbacks_are_last":
        "compares trainer.callbacks with an exact list: the entry point adds UnisonStop to every Trainer",
    "tests_pytorch/trainer/connectors/test_callback_connector.py::test_attach_model_callbacks":
        "compares trainer.callbacks with an exact list: the entry point adds UnisonStop to every Trainer",
}
PER_TEST_TIMEOUT = 120  # seconds, pytest-timeout; the whole run has its own bound below
RUN_TIMEOUT = 1200


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    outcomes: dict[str, str]  # test id -> passed / failed / error / skipped
    log: Path
    returncode: int
    finished: bool  # pytest wrote its report: it was not killed or cut short

    def count(self, outcome: str) -> int:
        return sum(1 for value in self.outcomes.values() if value == outcome)

    def summary(self) -> str:
        counts = ", ".join(f"{self.count(o)} {o}" for o in ("passed", "failed", "error", "skipped") if self.count(o))
        if not self.finished:
            return f"{self.name}: pytest ended with exit code {self.returncode} before writing its report (log: {self.log})"
        return f"{self.name}: {len(self.outcomes)} tests, {counts}"


def unpack(archive: Path, into: Path) -> Path:
    """The archive's ``tests/`` folder under ``into`` (unpacked once; the archive has one top folder)."""
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/")[0]
        tests = into / top / "tests"
        if not tests.is_dir():
            into.mkdir(parents=True, exist_ok=True)
            tar.extractall(into, filter="data")
    return tests


def run(name: str, tests: Path, files: list[str], env: dict[str, str], out: Path) -> Run:
    """Run pytest on ``files`` from Lightning's ``tests/`` folder, as Lightning's CI does, with ``env``
    deciding the package's switch (any other DDP_SIGTERM_* setting of the caller is left out)."""
    report, log = (out / f"{name}.xml").resolve(), (out / f"{name}.log").resolve()
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--color=no", "-q",
               f"--timeout={PER_TEST_TIMEOUT}", f"--junitxml={report}", *files]
    report.unlink(missing_ok=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DDP_SIGTERM")}
    with open(log, "w") as output:
        try:
            done = subprocess.run(command, cwd=tests, env={**environ, "OMP_NUM_THREADS": "1", **env}, stdout=output,
                                  stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT, check=False)
            returncode = done.returncode
        except subprocess.TimeoutExpired:
            returncode = -1
            output.write(f"\nupstream_suite: pytest did not finish within {RUN_TIMEOUT} s\n")
    finished = report.exists()
    return Run(name, read_junit(report, tests) if finished else {}, log, returncode, finished)


def read_junit(report: Path, tests: Path) -> dict[str, str]:
    """test id ("<file relative to tests/>::[Class::]name") -> outcome."""
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
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
        if outcomes.get(test_id) not in ("failed", "error"):
            outcomes[test_id] = outcome
    return outcomes


def differences(stock: Run, ours: Run) -> dict[str, tuple[str | None, str | None]]:
    ids = set(stock.outcomes) | set(ours.outcomes)
    return {i: (stock.outcomes.get(i), ours.outcomes.get(i)) for i in sorted(ids)
            if stock.outcomes.get(i) != ours.outcomes.get(i)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archive", type=Path, required=True, help="Lightning's tests, as in ../shared/upstream")
    parser.add_argument("--into", type=Path, default=Path("build"), help="where to unpack it")
    parser.add_argument("files", nargs="+", help="test files or folders, relative to the archive's tests/")
    args = parser.parse_args()
    tests = unpack(args.archive, args.into)
    out = args.into / "test-lightning"
    out.mkdir(parents=True, exist_ok=True)
    stock = run("stock", tests, args.files, {"DDP_SIGTERM": "0"}, out)
    ours = run("with-ddp_sigterm", tests, args.files, {"DDP_SIGTERM": "1"}, out)
    print(stock.summary())
    print(ours.summary())
    failed = False
    for run_ in (stock, ours):
        if not run_.finished or not run_.outcomes:
            print(f"error: the {run_.name} run did not finish or collected no test (log: {run_.log})")
            failed = True
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
        if outcome in ("failed", "error") and ours.outcomes.get(test_id) == outcome:
            print(f"note: {test_id} {outcome} in both runs (log: {stock.log})")
    print("test-lightning: " + ("FAILED" if failed else "passed: no difference but the accepted ones"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
