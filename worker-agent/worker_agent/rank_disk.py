"""How much disk a rank's work dir holds: what its supervisor checks against the rank's share.

A kubelet enforces ephemeral storage the same way: measure the directory now and then and end
the pod past its limit. No filesystem quota is needed, so it works under either runtime and on
any filesystem; the price is that a rank may overshoot for up to one check interval.

    used = dir_bytes(work_dir)      # allocated blocks, each hard-linked file once, no symlink followed

Standard library only (the supervisor imports it).
"""

from __future__ import annotations

import os
import stat


def dir_bytes(path: str | os.PathLike, *, stop_above: int | None = None) -> int:
    """Bytes allocated under ``path`` (blocks, so a sparse file counts what it holds). Stops
    early once past ``stop_above`` (the answer is then only known to exceed it). Entries that
    vanish or cannot be read while it walks are skipped."""
    total = 0
    seen: set[tuple[int, int]] = set()
    stack = [os.fspath(path)]
    while stack:
        top = stack.pop()
        try:
            entries = os.scandir(top)
        except OSError:
            continue
        with entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
                    continue
                if st.st_nlink > 1:
                    key = (st.st_dev, st.st_ino)
                    if key in seen:
                        continue
                    seen.add(key)
                total += st.st_blocks * 512
                if stop_above is not None and total > stop_above:
                    return total
    return total
