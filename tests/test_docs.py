"""The documentation's links lead somewhere: every relative link in README.md, CHANGELOG.md, docs/ and the
patch series' descriptions names a file of the repository, and every ``#anchor`` a heading of the file it
points to (GitHub's anchors). Links to other sites are not fetched (CI has no network); they are listed by
``test_external_links_are_few_and_known`` so that a new one is a conscious addition. docs/slurm.md shows the
sbatch scripts tests/test_slurm.py submits, as they are. The README lists the tested releases the package
checks (``internals.CHECKED``), and the docs and examples call ``stop.<name>`` only for what
StopCoordinator has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ddp_sigterm_tests.repository import tool

from ddp_sigterm import StopCoordinator
from ddp_sigterm._lightning.internals import CHECKED

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md"),
                    *(ROOT / "patches").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
EXTERNAL = {
    "https://keepachangelog.com/en/1.1.0/",
    "https://semver.org/spec/v2.0.0.html",
    "https://github.com/python/cpython/issues/112275",
    "https://github.com/python/cpython/pull/112336",
    "https://github.com/Lightning-AI/pytorch-lightning/issues/20550",  # a stateful loader's state dropped on resume
}


def anchors(document: Path) -> set[str]:
    """GitHub's anchors for the headings of ``document``: lower case, punctuation dropped, spaces to dashes."""
    found = set()
    in_code = False
    for line in document.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def links(document: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", document.read_text(), flags=re.DOTALL)  # code blocks hold no links
    return LINK.findall(text)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_a_file_and_heading(document: Path) -> None:
    broken = []
    for target in links(document):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        destination = (document.parent / path).resolve() if path else document
        if not destination.exists():
            broken.append(f"{target}: no file {destination.relative_to(ROOT)}")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.relative_to(ROOT)}")
    assert not broken, f"{document.relative_to(ROOT)}: " + "; ".join(broken)


def test_external_links_are_few_and_known() -> None:
    found = {target for document in DOCUMENTS for target in links(document) if re.match(r"[a-z]+:", target)}
    assert found <= EXTERNAL, f"new external links (add them to EXTERNAL once checked by hand): {found - EXTERNAL}"


def test_docs_slurm_shows_the_sbatch_scripts_the_slurm_tests_submit() -> None:
    """docs/slurm.md shows each examples/slurm/*.sbatch as it is (tests/test_slurm.py submits those files)."""
    docs = (ROOT / "docs" / "slurm.md").read_text()
    scripts = sorted((ROOT / "examples" / "slurm").glob("*.sbatch"))
    assert scripts
    for script in scripts:
        assert script.read_text().rstrip() in docs, f"docs/slurm.md does not show {script.name} as it is"


def test_readme_lists_the_releases_the_package_checks() -> None:
    tested = re.search(r"\*\*Tested Lightning releases\*\*(.*?)\n\n", (ROOT / "README.md").read_text(), re.DOTALL)
    assert tested is not None
    listed = re.findall(r"\*\*(\d+\.\d+\.\d+)\*\*", tested.group(1))
    assert tuple(listed) == CHECKED


def test_the_coordinator_methods_the_docs_call_exist() -> None:
    sources = [path for path in [*DOCUMENTS, *(ROOT / "examples").glob("*.py")] if "patches" not in path.parts]
    texts = [path.read_text() for path in sources]
    called = {name for text in texts for name in re.findall(r"\bstop\.([a-z_]+)", text)}
    assert called, "no stop.<name> found: the pattern no longer matches the docs"
    assert sorted(name for name in called if not hasattr(StopCoordinator, name)) == []


def test_every_ci_stage_is_a_make_target_and_the_readme_test_command_is_one() -> None:
    """.ci/run and the workflow both run .ci/stages: each stage's target must exist, and make test must be there."""
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    found = tool("ci_stages").stages()
    for stage in found:
        words = str(stage["command"]).split()
        assert words[0] == "make", stage
        assert words[1] in targets, stage
        assert stage["needs"] in ("", "sources", "root"), stage
        assert stage["runs"] in ("alone", "beside"), stage
    assert "make test" in [stage["command"] for stage in found]
    assert "tools/ci_stages.py" in (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    assert ".ci/stages" in (ROOT / ".ci" / "run").read_text()
