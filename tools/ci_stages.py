"""The CI's stages (.ci/stages) as the workflow's job matrix: ``python tools/ci_stages.py`` prints it as JSON."""

from __future__ import annotations

import json
from pathlib import Path

STAGES = Path(__file__).resolve().parent.parent / ".ci" / "stages"


def stages(path: Path = STAGES) -> list[dict[str, str | int]]:
    """One entry per stage line: name, python, needs ("sources", "root" or ""), minutes, command."""
    found: list[dict[str, str | int]] = []
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, python, needs, minutes, command = line.split(maxsplit=4)
        found.append({"name": name, "python": python, "needs": "" if needs == "-" else needs,
                      "minutes": int(minutes), "command": command})
    return found


if __name__ == "__main__":
    print(json.dumps({"include": stages()}))
