"""The host side of the spaces a rank gets in its own mount namespace (worker_agent.rank_mounts,
worker_agent.rank_ipc): its own tmp dir, its job's /dev/shm dir and its job's IPC pin on a node,
made before the rank starts and let go after the job's last rank on the node has ended.

    spaces = JobSpaces(node_state_dir, node_id)
    spaces.rank_tmp(work, user, needed)   # <work>/tmp, and the paths to keep in reach under /tmp
    spaces.job_shm(job_id, user, size)    # a tmpfs: /dev/shm/gpufleet/<node>.<state dir hash>/<keyed hash>
    spaces.ipc_pin(job_id)                # <node state>/ipc/<keyed hash of the job id>
    spaces.release(live_job_ids)          # every job's that has no live rank here goes
    spaces.close()                        # no rank left: all of it, the node's dir too
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
import zlib
from collections.abc import Iterable
from pathlib import Path

from worker_agent import libc_calls as libc
from worker_agent import rank_ipc, rank_mounts
from worker_agent import statefiles as sf
from worker_agent.libc_calls import MNT_DETACH, MS_NODEV, MS_NOSUID, MS_REMOUNT
from worker_agent.rank_access import RankAccessError
from worker_agent.rank_limits import filesystem_bytes

log = logging.getLogger("gpufleet.agent")

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # a job id that may name a dir as it is


@functools.cache
def tmpfs_problem() -> str | None:
    """Why a job's /dev/shm cannot be a tmpfs of its own here (a tmpfs mounted and unmounted
    on a dir of this host's tmp), or None."""
    probe = tempfile.mkdtemp(prefix="gpufleet-shm-probe-")
    try:
        libc.mount(b"tmpfs", os.fsencode(probe), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m", "mount -t tmpfs")
        libc.umount(os.fsencode(probe), MNT_DETACH, "umount")
    except OSError as e:
        return str(e)
    finally:
        os.rmdir(probe)
    return None


class JobSpaces:
    def __init__(self, node_dir: Path, node_id: str) -> None:
        self.node_id = node_id
        # named by the state dir too: two stacks on one host (the tests beside a developer's
        # `make up`) host nodes of the same ids, and must never sweep each other's
        stack = zlib.crc32(os.path.realpath(node_dir).encode())
        self.shm_dir = Path(rank_mounts.SHM_DIR) / "gpufleet" / f"{node_id}.{stack:08x}"
        self.ipc_dir = node_dir / "ipc"  # the agent's state: 0700, root's
        self._key_file = node_dir / "ipc-key.json"  # named for its first use; it keys every mount of a job
        self._key: bytes | None = None

    def rank_tmp(self, work: Path, user: tuple[int, int], needed: Iterable[str | None]) -> dict:
        """The rank's own tmp dir (``<work>/tmp``, its user's, 0700), and the real paths of
        ``needed`` (its work dir, checkpoint dir, the GPU device dir) its mounts keep in reach."""
        tmp = work / "tmp"
        self._own_dir(tmp, user)
        return {"dir": str(tmp), "keep": sorted({os.path.realpath(p) for p in needed if p})}

    def job_shm(self, job_id: str, user: tuple[int, int], size_bytes: int | None = None) -> str:
        """The job's own /dev/shm dir on this node (its user's, 0700), made by its first rank
        here and shared by the rest. The dirs above it may be passed through only.

        With ``size_bytes`` it is a tmpfs of its own of that size (grown, never shrunk, when
        a later rank of the job here asks for more): on the host's one tmpfs, one job could
        fill it, half the host's memory that nothing can swap or reclaim, and leave the other
        jobs' ranks on the node no shared memory (NCCL's transport, data loaders) and the
        node's memory to the OOM killer. The mount is named as the job's IPC pin is (a keyed
        hash, not the id): every rank's mount namespace starts as a copy of the host's. A dir
        already there by the job's id (made before this, or with no size, for a rank still
        running) stays as it is: a new mount would part the job's next rank from its
        segments."""
        if not SAFE_NAME.fullmatch(job_id):
            raise RankAccessError(f"job id {job_id!r} cannot name a dir")
        for above in (self.shm_dir.parent, self.shm_dir):
            above.mkdir(mode=0o711, exist_ok=True)
            os.chmod(above, 0o711)
        plain = self.shm_dir / job_id
        if size_bytes is None or plain.is_dir():
            self._own_dir(plain, user)
            return str(plain)
        job = self.shm_dir / self._keyed(job_id)
        if os.path.ismount(job):
            self._grow_tmpfs(job, user, size_bytes)
            return str(job)
        self._own_dir(job, user)
        libc.mount(
            b"tmpfs", os.fsencode(job), b"tmpfs", MS_NOSUID | MS_NODEV, f"size={size_bytes},mode=0700".encode(),
            f"mount -t tmpfs -o size={size_bytes} tmpfs {job}",
        )  # fmt: skip
        os.chown(job, *user)  # not as a mount option: another rank reads the options in its mountinfo
        return str(job)

    @staticmethod
    def _grow_tmpfs(job: Path, user: tuple[int, int], size_bytes: int) -> None:
        st = os.stat(job)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != user[0]:
            raise RankAccessError(f"{job} is mounted and is not a dir of the rank's user")
        if filesystem_bytes(job) < size_bytes:  # a bind of it in a rank's namespace grows with it
            libc.mount(
                b"tmpfs", os.fsencode(job), b"tmpfs", MS_REMOUNT | MS_NOSUID | MS_NODEV,
                f"size={size_bytes}".encode(), f"mount -o remount,size={size_bytes} {job}",
            )  # fmt: skip

    def ipc_pin(self, job_id: str) -> Path:
        """Where a job's IPC namespace is pinned, named by ``_keyed``: a pin is a mount."""
        return self.ipc_dir / self._keyed(job_id)

    def _keyed(self, job_id: str) -> str:
        """A name for a mount of the job's: a hash of its id keyed with a secret of the node's
        state, not the id, as every rank's mount namespace starts as a copy of the host's, so
        by id any rank would read the other jobs on its node in its /proc/self/mountinfo. The
        key outlives the agent: a restarted one finds its mounts."""
        if self._key is None:
            kept = sf.read_json(self._key_file) or {}
            self._key = bytes.fromhex(kept["key"]) if kept.get("key") else os.urandom(16)
            if not kept.get("key"):
                sf.write_json_atomic(self._key_file, {"key": self._key.hex()}, fsync=True)
        return hashlib.sha256(self._key + job_id.encode()).hexdigest()[:32]

    def release(self, live_jobs: set[str]) -> None:
        """Delete the /dev/shm dir and unpin the IPC namespace of every job not in
        ``live_jobs``: what a killed rank never unlinked or removed goes with them. Also
        what is left after its setting was turned off."""
        if self.shm_dir.is_dir():
            keep = set(live_jobs) | {self._keyed(job) for job in live_jobs}
            for d in self.shm_dir.iterdir():
                if d.name not in keep:
                    self._remove_shm(d)
        if self.ipc_dir.is_dir():
            pins = {self._keyed(job) for job in live_jobs}
            for f in self.ipc_dir.iterdir():
                pin = f.name.removesuffix(".lock")
                if pin not in pins:
                    try:
                        rank_ipc.remove(str(self.ipc_dir / pin))
                    except OSError as e:
                        log.warning("%s: cannot let a job's IPC namespace go (%s): %s", self.node_id, pin, e)

    def _remove_shm(self, job: Path) -> None:
        """A job's /dev/shm: its tmpfs unmounted (its memory given back once no rank's
        namespace holds it), then the dir."""
        if os.path.ismount(job):
            try:
                libc.umount(os.fsencode(job), MNT_DETACH, f"umount {job}")
            except OSError as e:
                log.warning("%s: cannot let a job's /dev/shm go (%s): %s", self.node_id, job.name, e)
                return
        shutil.rmtree(job, ignore_errors=True)

    def close(self) -> None:
        """With no live rank on the node: every job's spaces go, and the node's /dev/shm dir."""
        self.release(set())
        try:
            self.shm_dir.rmdir()
        except OSError:
            pass  # not there, or a rank's dir came meanwhile

    @staticmethod
    def _own_dir(path: Path, user: tuple[int, int]) -> None:
        """``path`` made the user's, 0700; one already there must be a dir of that user's."""
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != user[0]:
                raise RankAccessError(f"{path} exists and is not a dir of the rank's user") from None
        os.chown(path, *user)
        os.chmod(path, 0o700)
