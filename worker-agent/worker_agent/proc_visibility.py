"""Whether a rank can see other users' processes: ``/proc`` mounted with ``hidepid``.

Without it every process's command line (``/proc/<pid>/cmdline``) is readable by every user,
so a rank on a shared node reads the commands, and any token passed as an argument, of the
ranks of other jobs beside it. Each rank gets its own ``/proc`` where the kernel allows
(worker_agent.rank_mounts, which reads its new mount here); where it does not, the host can
(``mount -o remount,hidepid=invisible,gid=<group that monitors> /proc``), and the agent
checks at start and says so (docs/security.md, "What the process runtime cannot isolate").
"""

from __future__ import annotations

from pathlib import Path

HIDING = {"1", "2", "noaccess", "invisible"}  # hidepid values that keep others' processes from a user


def proc_hides_pids(mountinfo: str, mount_point: str = "/proc") -> bool | None:
    """From ``/proc/self/mountinfo``: True if ``mount_point`` is a proc mount with a hidepid
    that hides other users' processes, False if not, None if there is no such mount. Of
    mounts stacked on the point, the last listed is the one seen (a rank's own, worker_agent.rank_mounts)."""
    seen = None
    for line in mountinfo.splitlines():
        mount, sep, fs = line.partition(" - ")  # mount fields, then: type, source, super options
        fields, fs_fields = mount.split(), fs.split()
        if not sep or len(fields) < 6 or fields[4] != mount_point:
            continue
        if fs_fields[:1] != ["proc"]:
            seen = None
            continue
        options = fields[5].split(",") + (fs_fields[2].split(",") if len(fs_fields) > 2 else [])
        seen = any(o.removeprefix("hidepid=") in HIDING for o in options if o.startswith("hidepid="))
    return seen


def this_host_hides_pids() -> bool | None:
    try:
        return proc_hides_pids(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return None
