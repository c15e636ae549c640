"""The libc calls a rank's own namespaces are made with (worker_agent.rank_mounts,
worker_agent.rank_ipc): looked up once, at import, so a forked child before exec only calls
them; each raises an OSError that names the step that failed.

Standard library only (the supervisor imports it)."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 0x2, 0x4, 0x8, 0x20
MS_BIND, MS_REC, MS_SLAVE = 0x1000, 0x4000, 1 << 19
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int, data: bytes | None, what: str) -> None:
    _check(_libc.mount(source, target, fstype, flags, data), what)


def umount(target: bytes, flags: int, what: str) -> None:
    _check(_libc.umount2(target, flags), what)


def unshare(flags: int, what: str) -> None:
    _check(_libc.unshare(flags), what)


def setns(fd: int, nstype: int, what: str) -> None:
    _check(_libc.setns(fd, nstype), what)
