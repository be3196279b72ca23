"""DataLoader workers are forked by ranks whose other threads run on: gloo's, the package's. On CPython before
3.11.10 (and 3.12.0) a child forked while another thread holds the interpreter's lock of thread states hangs before
it runs a line (gh-112275; docs/reliability.md). A thread that torch made in C++ takes that lock, without the GIL,
each time it needs Python and has no thread state: gloo's worker thread does when it frees the last hold of a
collective's work on a tensor that Python also holds. The package's heartbeat must not be such a source: between
stops it is the package's only collective, every half ``max_delay``.

Seen with gdb, a breakpoint on PyThreadState_New in a rank: stock Lightning's own collectives make such thread
states; before the heartbeat kept its last work until the next beat, each of its heartbeats made one too."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ddp_sigterm_tests.harness import HERE, free_port, supervise

GDB = shutil.which("gdb")
WATCH_SECONDS = 6.0  # gdb watches rank 0 this long: with heartbeats every 5 ms, about a thousand
GDB_COMMANDS = """set pagination off
set print thread-events off
break PyThreadState_New
commands
silent
printf "=== PyThreadState_New\\n"
bt 12
continue
end
continue
"""


@pytest.mark.extended
@pytest.mark.skipif(GDB is None, reason="needs gdb (.ci/run installs it) to see where Python thread states are made")
def test_the_heartbeat_makes_no_python_thread_state_in_gloos_threads(tmp_path: Path) -> None:
    """Two ranks beat every 5 ms; gdb counts, in rank 0, the Python thread states that gloo's worker threads
    make. The heartbeat holds its last work until the next beat, so this thread frees it: none."""
    (tmp_path / "gdb.commands").write_text(GDB_COMMANDS)
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2",
           "HEARTBEAT_PERIOD": "0.005", "HEARTBEAT_SECONDS": str(WATCH_SECONDS + 20)}
    script = [sys.executable, str(HERE / "heartbeat_only.py")]
    gdb: subprocess.Popen | None = None
    started = 0.0

    def attach_gdb_once_beating(procs: dict[str, subprocess.Popen]) -> None:
        nonlocal gdb, started
        if gdb is None and "beating" in (tmp_path / "rank0.log").read_text():
            started = time.monotonic()
            with open(tmp_path / "gdb.log", "w") as gdb_log:
                gdb = subprocess.Popen([str(GDB), "-p", str(procs["rank0"].pid), "-batch", "-x",
                                        str(tmp_path / "gdb.commands")], stdout=gdb_log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        if gdb is not None and gdb.poll() is None and time.monotonic() - started > WATCH_SECONDS:
            gdb.send_signal(signal.SIGINT)  # gdb stops the rank, removes its breakpoint and detaches
            gdb.wait(timeout=30)

    try:
        run = supervise(tmp_path, {f"rank{r}": (script, {**env, "RANK": str(r)}) for r in (0, 1)}, timeout=120.0,
                        on_poll=attach_gdb_once_beating)
    finally:
        if gdb is not None and gdb.poll() is None:
            gdb.kill()
    log = (tmp_path / "gdb.log").read_text()
    why = f"{run.returncodes}\n{run.output()}\n{log[-3000:]}"
    assert run.returncodes == {"rank0": 0, "rank1": 0}, why
    assert "Breakpoint 1 at" in log, why  # gdb did watch
    made = [trace for trace in log.split("=== PyThreadState_New")[1:] if "ProcessGroupGloo" in trace]
    assert made == [], f"{len(made)} thread states made by gloo's threads; the first:\n{made[0] if made else ''}"
    assert "ended" in (tmp_path / "rank0.log").read_text(), why
