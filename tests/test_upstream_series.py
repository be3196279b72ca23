"""The pull requests of patches/ keep the shape a Lightning maintainer merges (docs/upstream.md): PR 1 small and
without machinery, texts of 50-200 words before the checklist that say which issue they fix, and a release series that
carries the same code as the master one. Reads the files only; make test-upstream and make test-patched run them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ddp_sigterm_tests.repository import ROOT, tool

series_lines = tool("upstream_suite").series_lines
PATCHES = ROOT / "patches"
MASTER = PATCHES / "lightning-master"
RELEASE = PATCHES / "lightning-2.6.6"
PULLS = series_lines(MASTER / "series")
# lines PR 1 changes (adds or removes) in src/, CHANGELOG not counted (issue 51)
PR1_SOURCE_LINES = 45


def changed_lines(patch: Path) -> dict[str, list[str]]:
    """File -> its added and removed lines ("+..." / "-...") in a patch."""
    lines: dict[str, list[str]] = {}
    current = None
    for line in patch.read_text().splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1]
            lines[current] = []
        elif current and line[:1] in "+-" and not line.startswith(("+++ ", "--- ")):
            lines[current].append(line)
    return lines


def source_lines(patch: Path) -> list[str]:
    return [line for name, changed in changed_lines(patch).items()
            if name.startswith("src/") and not name.endswith("CHANGELOG.md") for line in changed]


def patches_of(folder: Path) -> list[Path]:
    return [folder / name for name in series_lines(folder / "series")]


def test_pr1_is_small_and_has_no_thread_extra_process_group_or_barrier() -> None:
    (patch,) = patches_of(MASTER / PULLS[0])
    changed = source_lines(patch)
    assert len(changed) <= PR1_SOURCE_LINES, f"{len(changed)} source lines changed"
    added = [line for line in changed if line.startswith("+")]
    for machinery in ("threading", "new_group", "Thread(", "barrier(", "strategy.reduce("):
        assert machinery not in "\n".join(added), machinery


@pytest.mark.parametrize("pull", PULLS)
def test_description_is_short_and_names_its_issue(pull: str) -> None:
    text = (MASTER / pull / "DESCRIPTION.md").read_text()
    body = text.split("## What does this PR do?", 1)[1].split("<details>", 1)[0]
    words = len(re.findall(r"\S+", body))
    assert 50 <= words <= 200, f"{words} words before the checklist"
    assert re.search(r"Fixes #\d+|Fixes the bug in `ISSUE.md`|No issue|No Lightning issue", body), body


def test_release_series_carries_the_same_code_as_the_pull_requests() -> None:
    release = patches_of(RELEASE)[1:]  # 0001 is master's #21623, backported
    assert len(release) == len(PULLS)
    for pull, picked in zip(PULLS, release):
        (patch,) = patches_of(MASTER / pull)
        ours = {name: changed for name, changed in changed_lines(patch).items() if not name.endswith("CHANGELOG.md")}
        theirs = {name: changed for name, changed in changed_lines(picked).items()
                  if not name.endswith("CHANGELOG.md")}
        assert ours == theirs, f"{picked.name} differs from {pull} outside the CHANGELOG"


def test_both_series_name_the_same_base() -> None:
    assert series_lines(MASTER / "base") == series_lines(RELEASE / "base") == ["pr21666.diff", "pr21665.diff"]
