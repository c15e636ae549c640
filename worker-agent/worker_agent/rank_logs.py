"""A rank's output as the agent keeps it: written by the supervisor, read by the log server.

Standard library only: the supervisor imports this and must start fast.

The supervisor reads the rank's stdout and stderr through two FIFOs in the lease dir
(``stdout.pipe``, ``stderr.pipe``) and writes what it reads to:

* ``stdout.log`` / ``stderr.log``: each stream's bytes as the rank wrote them, at once
  (rotated to ``.1`` .. ``.<keep>``);
* the record log, ``output.<start>.log`` segments: one record per line,
  ``<unix time> <o|e> <L|P> <payload>\\n`` (``L`` a whole line, ``P`` a partial one: a line
  with no newline yet, flushed after ``PARTIAL_FLUSH_S`` or ``MAX_RECORD`` bytes). Its
  offsets are logical: a segment is named by the offset of its first byte, and a new
  segment starts when one reaches its size, so an offset stays valid across rotation
  (until its segment is dropped) and a follower just moves on to the next segment.

The rank's end of each FIFO is opened read-write: the rank itself holds the pipe open for
reading, so a write never fails with EPIPE when the supervisor dies; it blocks once the
pipe is full, until a new supervisor (``--adopt``) opens the FIFO by its path and reads on.

A lease's logs take at most ``max_bytes`` (plus a record): half for the record log (what
the log server serves), a quarter for each stream's file; each split in ``keep + 1`` files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

STREAMS = ("stdout", "stderr")
_CODE = {"stdout": b"o", "stderr": b"e"}
_STREAM = {b"o": "stdout", b"e": "stderr"}
PIPE = "{}.pipe"
SEGMENT = re.compile(r"^output\.(\d{16})\.log$")
PARTIAL_FLUSH_S = 0.5  # a line with no newline is written out after this long
MAX_RECORD = 64 * 1024  # or once it is this long
PIPE_SIZE = 1 << 20  # what a rank can write while no supervisor reads (best effort)
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_KEEP = 3
_READ = 64 * 1024


class Record(NamedTuple):
    offset: int  # logical offset just after the record: where to resume
    time: float
    stream: str
    partial: bool
    payload: bytes


def segment_name(start: int) -> str:
    return f"output.{start:016d}.log"


def segments(lease_dir: Path) -> list[tuple[int, Path]]:
    """The record log's segments, oldest first, as (logical start, path)."""
    try:
        names = os.listdir(lease_dir)
    except OSError:
        return []
    out = []
    for name in names:
        m = SEGMENT.match(name)
        if m:
            out.append((int(m.group(1)), lease_dir / name))
    return sorted(out)


# ---------------------------------------------------------------------------- writing


class RotatingFile:
    """Appends bytes to ``path``; past ``max_bytes`` it becomes ``path.1`` (and ``.1`` ``.2``...,
    ``keep`` kept). A reader holding the old file keeps reading it."""

    def __init__(self, path: Path, max_bytes: int, keep: int) -> None:
        self.path = path
        self.max_bytes = max(1, max_bytes)
        self.keep = max(0, keep)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.size = os.fstat(self.fd).st_size

    def write(self, data: bytes) -> None:
        if self.size and self.size + len(data) > self.max_bytes:
            os.close(self.fd)
            for i in range(self.keep, 0, -1):
                src = self.path if i == 1 else self.path.with_name(f"{self.path.name}.{i - 1}")
                with contextlib.suppress(FileNotFoundError):
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i}"))
            if self.keep == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
            self.size = 0
        os.write(self.fd, data)
        self.size += len(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class RecordLog:
    """The record log's writer: appends whole records, starts a new segment past
    ``segment_bytes`` and drops the oldest beyond ``keep + 1`` segments."""

    def __init__(self, lease_dir: Path, segment_bytes: int, keep: int) -> None:
        self.dir = lease_dir
        self.segment_bytes = max(1, segment_bytes)
        self.keep = max(0, keep)
        segs = segments(lease_dir)
        self.start = segs[-1][0] if segs else 0
        self.fd = os.open(lease_dir / segment_name(self.start), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.size = os.fstat(self.fd).st_size

    @property
    def end(self) -> int:
        return self.start + self.size

    def append(self, t: float, stream: str, partial: bool, payload: bytes) -> None:
        rec = b"%.6f %s %s %s\n" % (t, _CODE[stream], b"P" if partial else b"L", payload)
        if self.size and self.size + len(rec) > self.segment_bytes:
            os.close(self.fd)
            self.start += self.size
            self.fd = os.open(self.dir / segment_name(self.start), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self.size = 0
            for _, old in segments(self.dir)[: -(self.keep + 1)]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(old)
        os.write(self.fd, rec)
        self.size += len(rec)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def make_pipes(lease_dir: Path) -> dict[str, int]:
    """Create the FIFOs; return the rank's ends (read-write, see the module doc)."""
    ends = {}
    for s in STREAMS:
        p = lease_dir / PIPE.format(s)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
        os.mkfifo(p, 0o600)
        ends[s] = os.open(p, os.O_RDWR)
        with contextlib.suppress(OSError, AttributeError):
            fcntl.fcntl(ends[s], fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    return ends


class Relay:
    """Reads the FIFOs (in a thread of the supervisor) into the stream files and the record log."""

    def __init__(self, lease_dir: Path, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP) -> None:
        per = max(1, max_bytes // (keep + 1))
        self.records = RecordLog(lease_dir, per // 2, keep)
        self.files = {
            "stdout": RotatingFile(lease_dir / "stdout.log", per // 4, keep),
            "stderr": RotatingFile(lease_dir / "stderr.log", per // 4, keep),
        }
        self.fds: dict[int, str] = {}
        for s in STREAMS:
            p = lease_dir / PIPE.format(s)
            if p.exists():  # a rank started before FIFOs writes to the files itself
                self.fds[os.open(p, os.O_RDONLY | os.O_NONBLOCK)] = s
        self.pending: dict[str, bytearray] = {s: bytearray() for s in STREAMS}
        self.pending_since: dict[str, float] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="log-relay", daemon=True)
        self.thread.start()

    def write(self, stream: str, data: bytes, now: float | None = None) -> None:
        """What a stream carried: to its file at once, to the record log line by line."""
        now = time.time() if now is None else now
        with self.lock:
            self.files[stream].write(data)
            buf = self.pending[stream]
            if not buf:
                self.pending_since[stream] = now
            buf += data
            while True:
                i = buf.find(b"\n", 0, MAX_RECORD + 1)
                if i >= 0:
                    self.records.append(now, stream, False, bytes(buf[:i]))
                    del buf[: i + 1]
                elif len(buf) >= MAX_RECORD:  # a line this long goes out in pieces
                    self.records.append(now, stream, True, bytes(buf[:MAX_RECORD]))
                    del buf[:MAX_RECORD]
                else:
                    break
                self.pending_since[stream] = now

    def flush_partial(self, older_than: float = 0.0, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self.lock:
            for s, buf in self.pending.items():
                if buf and now - self.pending_since.get(s, now) >= older_than:
                    self.records.append(now, s, True, bytes(buf))
                    buf.clear()

    def _run(self) -> None:
        while self.fds and not self.stopping.is_set():
            timeout = PARTIAL_FLUSH_S / 2
            try:
                ready, _, _ = select.select(list(self.fds), [], [], timeout)
            except (OSError, ValueError):
                break
            for fd in ready:
                try:
                    data = os.read(fd, _READ)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    self.write(self.fds[fd], data)
                else:  # every writer is gone
                    os.close(fd)
                    del self.fds[fd]
            self.flush_partial(PARTIAL_FLUSH_S)

    def finish(self, timeout: float) -> None:
        """After the rank (and its group) ended: read what is left, then flush and close.
        A daemon that escaped the group and holds the pipe is not waited for beyond ``timeout``."""
        if self.thread is not None:
            self.thread.join(timeout)
            self.stopping.set()
            self.thread.join(PARTIAL_FLUSH_S + 1.0)
        self.flush_partial()
        with self.lock:
            self.records.close()
            for f in self.files.values():
                f.close()
        for fd in list(self.fds):
            with contextlib.suppress(OSError):
                os.close(fd)


# ---------------------------------------------------------------------------- reading


def _parse(line: bytes, end: int) -> Record | None:
    parts = line.split(b" ", 3)
    if len(parts) != 4 or parts[1] not in _STREAM:
        return None
    try:
        t = float(parts[0])
    except ValueError:
        return None
    return Record(end, t, _STREAM[parts[1]], parts[2] == b"P", parts[3])


def read_records(lease_dir: Path, offset: int = 0, max_bytes: int = 1 << 20) -> Iterator[Record]:
    """Whole records from logical ``offset`` on (from the oldest kept one when ``offset`` was
    rotated away), about ``max_bytes`` of them at most; a record being written is left for later."""
    segs = segments(lease_dir)
    read = 0
    for i, (start, path) in enumerate(segs):
        nxt = segs[i + 1][0] if i + 1 < len(segs) else None
        if nxt is not None and offset >= nxt:
            continue
        pos = max(0, offset - start)
        try:
            f = open(path, "rb")
        except FileNotFoundError:  # dropped since we listed: the next one holds what follows
            continue
        with f:
            f.seek(pos)
            for line in f:
                if not line.endswith(b"\n"):
                    return  # torn: written next
                pos += len(line)
                offset = start + pos
                rec = _parse(line[:-1], offset)
                if rec is not None:
                    yield rec
                read += len(line)
                if read >= max_bytes:
                    return
        offset = max(offset, nxt or offset)


def end_offset(lease_dir: Path) -> int:
    segs = segments(lease_dir)
    if not segs:
        return 0
    start, path = segs[-1]
    try:
        return start + path.stat().st_size
    except FileNotFoundError:
        return start


def tail_offset(lease_dir: Path, n: int, stream: str | None = None) -> int:
    """The logical offset from which the last ``n`` records (of ``stream``, or of both) start."""
    if n <= 0:
        return end_offset(lease_dir)
    code = None if stream is None else _CODE[stream]
    found = 0
    for start, path in reversed(segments(lease_dir)):
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            continue
        with f:
            pos = f.seek(0, 2)
            carry = b""
            first = True
            while pos > 0:
                step = min(_READ, pos)
                pos -= step
                f.seek(pos)
                block = f.read(step) + carry
                if first:  # a record being written at the end is not one yet
                    block = block[: block.rfind(b"\n") + 1]
                    first = False
                lines = block.split(b"\n")
                carry = lines[0] if pos > 0 else b""
                body = lines[1:] if pos > 0 else lines
                # offsets: the end of ``carry`` (or ``pos``) + each line
                at = pos + len(lines[0]) + 1 if pos > 0 else 0
                starts = []
                for ln in body:
                    starts.append((at, ln))
                    at += len(ln) + 1
                for rec_start, ln in reversed(starts):
                    if not ln:
                        continue
                    p = ln.split(b" ", 2)
                    if len(p) == 3 and (code is None or p[1] == code):
                        found += 1
                        if found >= n:
                            return start + rec_start
    segs = segments(lease_dir)
    return segs[0][0] if segs else 0
