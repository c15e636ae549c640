"""What a rank's terminal report says about why it ended (docs/design.md, Reports).

    tail = stderr_tail(lease_dir / "stderr.log")   # the last lines, bounded, always valid text
    sig = exit_signal(exit_record)                 # the signal that killed it, or None

Standard library only (the agent reads it while it builds the report).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TAIL_LINES = 20
TAIL_BYTES = 4096


def stderr_tail(path: Path | str | None, *, max_lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> str:
    """The last ``max_lines`` lines of ``path``, at most ``max_bytes`` of it, decoded as UTF-8
    with invalid bytes replaced (a line cut by the byte bound loses its head, a multi-byte
    character cut there becomes one replacement character). "" when there is none."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            start = max(0, size - max_bytes)
            f.seek(start)
            data = f.read(max_bytes)
    except OSError:
        return ""
    if start > 0:
        # drop the partial first line when a whole one follows; otherwise keep the cut line
        nl = data.find(b"\n")
        if 0 <= nl < len(data) - 1:
            data = data[nl + 1 :]
    lines = data.decode("utf-8", errors="replace").splitlines()[-max_lines:]
    # NUL is replaced too: Postgres text and jsonb cannot hold it
    text = "\n".join(line.replace("\x00", "\ufffd") for line in lines)
    raw = text.encode()
    if len(raw) > max_bytes:  # replacement characters (3 bytes each) grew it: cut from the front
        text = raw[-max_bytes:].decode("utf-8", errors="ignore")
    return text


def exit_signal(record: dict[str, Any] | None) -> int | None:
    """The signal that killed the rank, as the supervisor recorded it (exit code 128 + N)."""
    sig = (record or {}).get("signal")
    return sig if isinstance(sig, int) and not isinstance(sig, bool) and 0 < sig < 128 else None
