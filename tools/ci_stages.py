"""The CI's stages (.ci/stages) as the workflow's job matrix: ``python tools/ci_stages.py`` prints it as JSON."""

from __future__ import annotations

import json
from pathlib import Path

STAGES = Path(__file__).resolve().parent.parent / ".ci" / "stages"


def stages(path: Path = STAGES) -> list[dict[str, str | int]]:
    """One entry per stage line: name, python, needs ("sources", "root" or ""), minutes, runs ("alone" or "beside"),
    command. The workflow runs every stage as a job of its own; only .ci/run reads ``runs``."""
    found: list[dict[str, str | int]] = []
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, python, needs, minutes, runs, command = line.split(maxsplit=5)
        found.append({"name": name, "python": python, "needs": "" if needs == "-" else needs,
                      "minutes": int(minutes), "runs": runs, "command": command})
    return found


if __name__ == "__main__":
    print(json.dumps({"include": stages()}))
