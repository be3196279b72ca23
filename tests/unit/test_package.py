"""ddp_sigterm itself: what importing its modules does (nothing but define things) and needs (torch, not
Lightning, for the core)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_package_registers_nothing() -> None:
    """Importing any module of the package defines things and does nothing else: no at-fork hook, no
    exit function, no thread, no signal handler (they come with a run, and go with it)."""
    script = (
        "import atexit, os, signal, threading\n"
        "registered = []\n"
        "atexit.register = lambda f, *a, **k: registered.append(f)\n"
        "os.register_at_fork = lambda **hooks: registered.extend(hooks.values())\n"
        "handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)}\n"
        "threads = threading.active_count()\n"
        "import torch, lightning.pytorch, pytorch_lightning  # what they register is theirs\n"
        "registered.clear()\n"
        "import importlib, pkgutil, ddp_sigterm\n"
        "modules = [m.name for m in pkgutil.walk_packages(ddp_sigterm.__path__, 'ddp_sigterm.')]\n"
        "assert len(modules) > 10 and 'ddp_sigterm._lightning.internals' in modules, modules\n"
        "for name in modules: importlib.import_module(name)\n"
        "assert registered == [], registered\n"
        "assert threading.active_count() == threads\n"
        "assert {s: signal.getsignal(s) for s in handlers} == handlers\n"
    )
    run_python(script)


def run_python(script: str) -> None:
    """Run ``script`` in a fresh interpreter (nothing imported yet); its assertions must hold."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_core_imports_no_lightning() -> None:
    """The core needs torch only: ``pip install ddp_sigterm`` without the [lightning] extra works."""
    script = (
        "import sys, ddp_sigterm, ddp_sigterm.slurm, ddp_sigterm._core.coordinator, ddp_sigterm._core.stop_save\n"
        "found = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "               ('lightning', 'pytorch_lightning', 'lightning_fabric', 'lightning_utilities'))\n"
        "assert not found, found\n"
    )
    run_python(script)
