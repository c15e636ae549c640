"""The host side of the spaces a rank gets in its own mount namespace (worker_agent.rank_mounts,
worker_agent.rank_ipc): its own tmp dir, its job's /dev/shm dir and its job's IPC pin on a node,
made before the rank starts and let go after the job's last rank on the node has ended.

    spaces = JobSpaces(node_state_dir, node_id)
    spaces.rank_tmp(work, user, needed)   # <work>/tmp, and the paths to keep in reach under /tmp
    spaces.job_shm(job_id, user)          # /dev/shm/gpufleet/<node>.<state dir hash>/<job>
    spaces.ipc_pin(job_id)                # <node state>/ipc/<keyed hash of the job id>
    spaces.release(live_job_ids)          # every job's that has no live rank here goes
    spaces.close()                        # no rank left: all of it, the node's dir too
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
import zlib
from collections.abc import Iterable
from pathlib import Path

from worker_agent import rank_ipc, rank_mounts
from worker_agent import statefiles as sf
from worker_agent.rank_access import RankAccessError

log = logging.getLogger("gpufleet.agent")

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # a job id that may name a dir as it is


class JobSpaces:
    def __init__(self, node_dir: Path, node_id: str) -> None:
        self.node_id = node_id
        # named by the state dir too: two stacks on one host (the tests beside a developer's
        # `make up`) host nodes of the same ids, and must never sweep each other's
        stack = zlib.crc32(os.path.realpath(node_dir).encode())
        self.shm_dir = Path(rank_mounts.SHM_DIR) / "gpufleet" / f"{node_id}.{stack:08x}"
        self.ipc_dir = node_dir / "ipc"  # the agent's state: 0700, root's
        self._key_file = node_dir / "ipc-key.json"
        self._key: bytes | None = None

    def rank_tmp(self, work: Path, user: tuple[int, int], needed: Iterable[str | None]) -> dict:
        """The rank's own tmp dir (``<work>/tmp``, its user's, 0700), and the real paths of
        ``needed`` (its work dir, checkpoint dir, the GPU device dir) its mounts keep in reach."""
        tmp = work / "tmp"
        self._own_dir(tmp, user)
        return {"dir": str(tmp), "keep": sorted({os.path.realpath(p) for p in needed if p})}

    def job_shm(self, job_id: str, user: tuple[int, int]) -> str:
        """The job's own /dev/shm dir on this node (its user's, 0700), made by its first rank
        here and shared by the rest. The dirs above it may be passed through only."""
        if not SAFE_NAME.fullmatch(job_id):
            raise RankAccessError(f"job id {job_id!r} cannot name a dir")
        for above in (self.shm_dir.parent, self.shm_dir):
            above.mkdir(mode=0o711, exist_ok=True)
            os.chmod(above, 0o711)
        job = self.shm_dir / job_id
        self._own_dir(job, user)
        return str(job)

    def ipc_pin(self, job_id: str) -> Path:
        """Where a job's IPC namespace is pinned, named by a hash of its id keyed with a secret
        of the node's state, not by the id: a pin is a mount, and every rank's mount namespace
        starts as a copy of the host's, so by id any rank would read the other jobs on its
        node in its /proc/self/mountinfo. The key outlives the agent: a restarted one finds
        its pins."""
        if self._key is None:
            kept = sf.read_json(self._key_file) or {}
            self._key = bytes.fromhex(kept["key"]) if kept.get("key") else os.urandom(16)
            if not kept.get("key"):
                sf.write_json_atomic(self._key_file, {"key": self._key.hex()}, fsync=True)
        return self.ipc_dir / hashlib.sha256(self._key + job_id.encode()).hexdigest()[:32]

    def release(self, live_jobs: set[str]) -> None:
        """Delete the /dev/shm dir and unpin the IPC namespace of every job not in
        ``live_jobs``: what a killed rank never unlinked or removed goes with them. Also
        what is left after its setting was turned off."""
        if self.shm_dir.is_dir():
            for d in self.shm_dir.iterdir():
                if d.name not in live_jobs:
                    shutil.rmtree(d, ignore_errors=True)
        if self.ipc_dir.is_dir():
            pins = {self.ipc_pin(job).name for job in live_jobs}
            for f in self.ipc_dir.iterdir():
                pin = f.name.removesuffix(".lock")
                if pin not in pins:
                    try:
                        rank_ipc.remove(str(self.ipc_dir / pin))
                    except OSError as e:
                        log.warning("%s: cannot let a job's IPC namespace go (%s): %s", self.node_id, pin, e)

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
