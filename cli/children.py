"""Starting a `gpufleet` child process the one way `gpufleet up` and the tests do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any


def spawn_gpufleet(args: list[str], env: dict[str, str], log_file: Path, **popen: Any) -> subprocess.Popen:
    """`python -m cli.main *args` with ``env``, output appended to ``log_file``, in a process
    group of its own: the terminal's Ctrl-C reaches the parent alone, which stops each child
    with SIGTERM (a SIGINT reaching a child still importing was a KeyboardInterrupt traceback
    in its log)."""
    with open(log_file, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "cli.main", *args], env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, process_group=0, **popen,
        )  # fmt: skip
