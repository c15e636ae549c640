"""The chaos teardown's last sweep (``ChaosStack._kill_leftovers``): a process of the stack
still on its way out when the sweep finds it (a postmaster after ``pg_ctl stop -w`` has
returned) is not a leftover; one still running after the grace is, and is killed. A CI run
failed on the first kind with nothing in its report to say which process it was; the sweep
now logs each one it finds.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from chaos.stack import ChaosStack

# a child in the stack's dir that exits by itself shortly after it is found
_EXITS_SOON = "import time; time.sleep(1.0)"
_STAYS = "import time; time.sleep(120)"


def _spawn(root: Path, code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], cwd=root, start_new_session=True)


def test_the_sweep_waits_for_a_process_on_its_way_out_and_kills_one_that_stays() -> None:
    root = Path(tempfile.mkdtemp(prefix="gpufleet-sweep-"))
    lines: list[str] = []
    stack = ChaosStack(root, log=lines.append)
    exiting, staying = _spawn(root, _EXITS_SOON), _spawn(root, _STAYS)
    try:
        assert {p["pid"] for p in stack.leftovers()} >= {exiting.pid, staying.pid}
        left = stack._kill_leftovers(grace_s=4.0)
        assert [p["pid"] for p in left] == [staying.pid], left
        assert staying.wait(10) == -9 and exiting.wait(10) == 0
        assert any(f"pid {exiting.pid} exited within" in x for x in lines), lines
        assert any(f"killing leftover pid {staying.pid}" in x for x in lines), lines
    finally:
        for p in (exiting, staying):
            if p.poll() is None:
                p.kill()
                p.wait()
        root.rmdir()


def test_without_a_grace_a_process_still_exiting_counts_as_left() -> None:
    root = Path(tempfile.mkdtemp(prefix="gpufleet-sweep-"))
    stack = ChaosStack(root)
    exiting = _spawn(root, _EXITS_SOON)
    try:
        left = stack._kill_leftovers()
        assert [p["pid"] for p in left] == [exiting.pid]
        assert exiting.wait(10) == -9  # killed on its way out, and reported
    finally:
        if exiting.poll() is None:
            exiting.kill()
            exiting.wait()
        root.rmdir()
