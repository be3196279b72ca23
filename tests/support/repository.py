"""The checkout the suite runs from: its root, and its tools (``tools/*.py``: programs that run by path, some with
any python3, not a package), loaded from their files by :func:`tool`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent.parent


def tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as the module ``tools.<name>``, loaded once."""
    qualified = f"tools.{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, ROOT / "tools" / f"{name}.py")
        if spec is None or spec.loader is None:
            raise ImportError(f"no tool {name} in {ROOT / 'tools'}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module  # before it runs: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[qualified]
