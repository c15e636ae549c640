"""A tiny helper for training scripts run by gpufleet (standard library; fsspec optional).

    from worker_agent.jobhelper import Job

    job = Job(checkpoint_every_steps=100)          # installs the SIGTERM handler
    resumed = job.resume()                         # (step, state) from GPUFLEET_RESUME_FROM, or None
    step, state = resumed or (0, init_state())
    while step < total:
        state = train_one_step(state); step += 1
        job.report_step(step)                      # hang detection (step counter)
        if job.stop_requested:                     # preempted: SIGTERM arrived
            job.exit_for_preemption(step, state)   # checkpoint now, wait for the copy, exit 143
        job.maybe_checkpoint(step, state)          # periodic, asynchronous
    job.wait_for_checkpoints()

Checkpoints: the state (JSON-serialisable, or bytes with ``checkpoint(..., raw=True)``)
is written locally first, then copied to ``GPUFLEET_CHECKPOINT_DIR`` in a
background thread as ``<dir>/step-<NNNNNNNN>/rank-<R>/state.json`` plus a
``COMPLETE`` marker; each completed one is recorded in ``GPUFLEET_PROGRESS_FILE``,
which the agent reports (victim choice counts the work since the last one). The
reported URI is the step directory; ``GPUFLEET_RESUME_FROM`` names one.

URIs: ``file:///abs/path`` or a plain absolute path work out of the box; other
schemes (``s3://``, ``gs://``...) go through fsspec where it is installed.

Exit code after a preemption checkpoint is 143 (128 + SIGTERM), so a stopped
rank never looks like a successful one.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

EXIT_PREEMPTED = 128 + signal.SIGTERM
STATE_FILE = "state.json"
COMPLETE = "COMPLETE"


def _local(uri: str) -> str | None:
    if uri.startswith("file://"):
        return uri[len("file://") :]
    if "://" not in uri:
        return uri
    return None


def _join(uri: str, *parts: str) -> str:
    return uri.rstrip("/") + "/" + "/".join(parts)


def _fs(uri: str):
    try:
        import fsspec
    except ImportError as e:
        raise RuntimeError(f"checkpoint URI {uri!r} needs fsspec (pip install fsspec and its backend)") from e
    return fsspec.core.url_to_fs(uri)


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class Job:
    def __init__(
        self,
        *,
        checkpoint_every_steps: int | None = None,
        checkpoint_every_s: float | None = None,
        handle_sigterm: bool = True,
        local_dir: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        e = os.environ if env is None else env
        self.job_id = e.get("GPUFLEET_JOB_ID", "local")
        self.attempt = int(e.get("GPUFLEET_ATTEMPT", "1"))
        self.rank = int(e.get("RANK", "0"))
        self.world_size = int(e.get("WORLD_SIZE", "1"))
        self.checkpoint_dir = e.get("GPUFLEET_CHECKPOINT_DIR", "")
        self.resume_from = e.get("GPUFLEET_RESUME_FROM") or None
        self.progress_file = e.get("GPUFLEET_PROGRESS_FILE") or None
        self.every_steps = checkpoint_every_steps
        self.every_s = checkpoint_every_s
        self.local_dir = Path(local_dir or tempfile.mkdtemp(prefix=f"gpufleet-ckpt-{self.rank}-"))
        self._own_local_dir = local_dir is None  # made here: removed at exit (a host's /tmp fills up)
        self.stop_requested = False
        self._progress: dict[str, Any] = {"step": None, "checkpoint_uri": None, "checkpoint_step": None}
        self._last_progress_write = 0.0
        self._last_ckpt_at = time.monotonic()
        self._last_ckpt_step: int | None = None
        self._n = 0
        self._lock = threading.Lock()
        self._copies: queue.Queue = queue.Queue()
        self._errors: list[BaseException] = []
        self._copier = threading.Thread(target=self._copy_loop, name="gpufleet-ckpt-copy", daemon=True)
        self._copier.start()
        if self._own_local_dir:
            atexit.register(self._remove_local_dir)
        if handle_sigterm:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    # ------------------------------------------------------------------ signals
    def _on_sigterm(self, _signum, _frame) -> None:
        self.stop_requested = True  # the training loop checkpoints at its next step boundary

    # ------------------------------------------------------------------ progress
    def report_step(self, step: int, *, force: bool = False) -> None:
        """Record progress for hang detection (written at most every 0.5 s unless ``force``)."""
        with self._lock:
            self._progress["step"] = int(step)
            now = time.monotonic()
            if force or now - self._last_progress_write >= 0.5:
                self._last_progress_write = now
                self._write_progress()

    def _write_progress(self) -> None:
        if not self.progress_file:
            return
        try:
            _write_atomic(Path(self.progress_file), json.dumps({**self._progress, "at": time.time()}).encode())
        except OSError as e:
            sys.stderr.write(f"gpufleet: cannot write progress: {e}\n")

    # ---------------------------------------------------------------- checkpoints
    def checkpoint_uri(self, step: int) -> str:
        if not self.checkpoint_dir:
            raise RuntimeError("GPUFLEET_CHECKPOINT_DIR is not set")
        return _join(self.checkpoint_dir, step_dir_name(step))

    def maybe_checkpoint(self, step: int, state: Any) -> str | None:
        due = (self.every_steps and step % self.every_steps == 0) or (
            self.every_s is not None and time.monotonic() - self._last_ckpt_at >= self.every_s
        )
        if due and step != self._last_ckpt_step:
            return self.checkpoint(step, state)
        return None

    def checkpoint(self, step: int, state: Any, *, sync: bool = False, raw: bool = False) -> str:
        """Write ``state`` locally now; copy it to the checkpoint URI in the background (or now if ``sync``)."""
        uri = self.checkpoint_uri(step)
        self._n += 1
        local = self.local_dir / f"{step_dir_name(step)}.{self._n}" / f"rank-{self.rank}"
        local.mkdir(parents=True, exist_ok=True)
        data = state if raw else json.dumps({"step": step, "state": state}, sort_keys=True).encode()
        _write_atomic(local / STATE_FILE, data)
        self._last_ckpt_at = time.monotonic()
        self._last_ckpt_step = step
        done = threading.Event()
        self._copies.put((step, local, uri, done))
        if sync:
            self.wait_for_checkpoints()
        return uri

    def wait_for_checkpoints(self, timeout: float | None = None) -> None:
        """Block until every queued checkpoint is copied (raises the first copy error)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._copies.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("checkpoint copies still running")
            time.sleep(0.01)
        if self._errors:
            raise RuntimeError(f"checkpoint copy failed: {self._errors[0]}") from self._errors[0]

    def _copy_loop(self) -> None:
        while True:
            step, local, uri, done = self._copies.get()
            try:
                self._publish(local, uri)
                with self._lock:
                    if self._progress["checkpoint_step"] is None or step >= self._progress["checkpoint_step"]:
                        self._progress["checkpoint_uri"] = uri
                        self._progress["checkpoint_step"] = step
                    self._write_progress()
                shutil.rmtree(local.parent, ignore_errors=True)
            except BaseException as e:  # reported by wait_for_checkpoints
                self._errors.append(e)
                sys.stderr.write(f"gpufleet: checkpoint copy to {uri} failed: {e}\n")
            finally:
                done.set()
                self._copies.task_done()

    def _remove_local_dir(self) -> None:
        """The staging dir this Job made, once no copy from it is pending (one still copying
        at exit may yet finish in its thread: its dir stays)."""
        if self._own_local_dir and not self._copies.unfinished_tasks:
            shutil.rmtree(self.local_dir, ignore_errors=True)

    def _publish(self, local: Path, step_uri: str) -> None:
        rank_part = f"rank-{self.rank}"
        dest = _local(step_uri)
        if dest is not None:
            final = Path(dest) / rank_part
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.with_name(f".{rank_part}.{os.getpid()}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(local, tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            (final / COMPLETE).write_bytes(b"")
            return
        fs, path = _fs(step_uri)
        target = path.rstrip("/") + "/" + rank_part
        fs.put(str(local), target, recursive=True)
        with fs.open(target + "/" + COMPLETE, "wb") as f:
            f.write(b"")

    # --------------------------------------------------------------------- resume
    def resume(self, uri: str | None = None, *, raw: bool = False) -> tuple[int, Any] | None:
        """(step, state) from ``uri`` / ``GPUFLEET_RESUME_FROM``; None when there is nothing to resume."""
        uri = uri or self.resume_from
        if not uri:
            return None
        data = self._read(_join(uri, f"rank-{self.rank}", STATE_FILE))
        if raw:
            return self._step_of(uri), data
        obj = json.loads(data)
        self._last_ckpt_step = int(obj["step"])
        with self._lock:
            self._progress.update(step=int(obj["step"]), checkpoint_uri=uri, checkpoint_step=int(obj["step"]))
            self._write_progress()
        return int(obj["step"]), obj["state"]

    def latest_checkpoint(self, directory: str | None = None) -> str | None:
        """The newest complete checkpoint of this rank under ``directory`` (default the job's), or None."""
        directory = directory or self.checkpoint_dir
        if not directory:
            return None
        local = _local(directory)
        if local is not None:
            root = Path(local)
            if not root.is_dir():
                return None
            steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
            for name in reversed(steps):
                if (root / name / f"rank-{self.rank}" / COMPLETE).exists():
                    return _join(directory, name)
            return None
        fs, path = _fs(directory)
        try:
            names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
        except FileNotFoundError:
            return None
        for name in reversed([n for n in names if n.startswith("step-")]):
            if fs.exists(f"{path.rstrip('/')}/{name}/rank-{self.rank}/{COMPLETE}"):
                return _join(directory, name)
        return None

    def _read(self, uri: str) -> bytes:
        local = _local(uri)
        if local is not None:
            return Path(local).read_bytes()
        fs, path = _fs(uri)
        with fs.open(path, "rb") as f:
            return f.read()

    @staticmethod
    def _step_of(uri: str) -> int:
        name = uri.rstrip("/").rsplit("/", 1)[-1]
        return int(name.split("-", 1)[1]) if name.startswith("step-") else 0

    # ---------------------------------------------------------------------- exits
    def exit_for_preemption(self, step: int, state: Any) -> None:
        """Checkpoint synchronously, record it, and exit with 143."""
        self.report_step(step, force=True)
        self.checkpoint(step, state, sync=True)
        self._remove_local_dir()  # os._exit skips atexit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_PREEMPTED)
