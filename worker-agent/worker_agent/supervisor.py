"""The per-rank supervisor: ``python -m worker_agent.supervisor <lease_dir> [--adopt]``.

One small process per rank (docs/design.md, Health). It detaches from the agent (double
fork + its own session), so the agent can die or restart without touching it:

* starts the rank as its own process group (``spec.json``: argv, env, cwd, logs);
* relays the rank's stdout and stderr (FIFOs it reads in a thread) to the lease's log
  files and its timestamped record log, with a size cap and rotation (worker_agent.rank_logs);
* records ``supervisor.json`` (its pid, the rank's pid/pgid and their start times,
  the boot id) so a restarted agent re-adopts the rank instead of starting it again;
* on ``stop.json`` (written by the agent, SIGUSR1 wakes us): SIGTERM to the group,
  SIGKILL when the grace period ends;
* self-fence: when the lease has gone unconfirmed (``confirmed.json``) for more than
  ``unconfirmed_kill_s``, SIGTERM then SIGKILL after ``fence_grace_s`` — even if the
  agent is dead;
* on SIGTERM to the supervisor itself: stops the rank the same way (node shutdown);
* with ``spec.cgroup`` (the process runtime's fence, worker_agent.rank_cgroup): makes the
  rank's cgroups with its share's limits before it starts, and the rank joins them before
  it drops to its user;
* with ``spec.private_proc``: the rank makes its own mount namespace (worker_agent.rank_mounts)
  before it drops to its user: a ``/proc`` showing only its own user's processes;
  ``spec.masked_gpus`` (the GPU nodes beside its own, where no cgroup denies them) masked;
  with ``spec.private_tmp`` its own dir bound over ``/tmp`` and ``/var/tmp``; with
  ``spec.shm`` its job's dir bound over ``/dev/shm``; with ``spec.ipc`` it joins its job's
  SysV IPC namespace on the node, made and pinned there by the job's first rank
  (worker_agent.rank_ipc);
* with ``spec.disk``: every ``check_s`` measures the rank's work dir, and ends a rank past
  its disk share (SIGTERM, SIGKILL after ``fence_grace_s``), saying so in its stderr;
* when the rank exits: SIGKILL to what is left of its group (and of its cgroups: a process
  that left the group goes too), says in its stderr when the OOM killer ended it, then
  writes ``exit.json`` once (state, exit code, signal, latest checkpoint from the rank's
  ``progress.json``).

``--adopt``: the previous supervisor died while its rank lives on; watch the rank
by pid identity instead of waitpid (exit code unknown) and keep enforcing stop
and self-fence.

Exit codes follow the shell: a rank killed by signal N exits 128 + N.
Standard library only.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from worker_agent import rank_disk, rank_logs
from worker_agent import statefiles as sf
from worker_agent.checkpoints import checkpoint_within
from worker_agent.rank_cgroup import RankCgroup
from worker_agent.rank_ipc import Claim, JobIpc
from worker_agent.rank_mounts import RankMounts

DRAIN_S = 1.0  # after the rank's group is gone: how long to read what a stray process still writes


class _Adopted:
    """A rank we did not start: poll it by pid identity."""

    def __init__(self, pid: int, start_ticks: int | None) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not sf.process_alive(self.pid, self.start_ticks):
            self.returncode = -255  # unknown
        return self.returncode


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _run_quiet(argv: list[str]) -> None:
    try:
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pass


def _log(msg: str) -> None:
    sys.stderr.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} supervisor[{os.getpid()}] {msg}\n")
    sys.stderr.flush()


def supervise(lease_dir: Path, adopt: bool = False) -> int:
    spec = sf.read_json(lease_dir / sf.SPEC)
    if spec is None:
        _log(f"no spec in {lease_dir}")
        return 2
    poll_s = float(spec.get("poll_s", 0.5))
    unconfirmed_kill_s = float(spec["unconfirmed_kill_s"])
    fence_grace_s = float(spec["fence_grace_s"])
    kill_argv = spec.get("kill_argv") or []
    boot_id = spec["boot_id"]

    # Wake-ups: a pipe written by the signal machinery; handlers only set flags.
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    os.set_blocking(rfd, False)
    signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    flags = {"term": False}

    def on_term(_signum, _frame):
        flags["term"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    signal.signal(signal.SIGCHLD, lambda *_: None)

    me = {
        "supervisor_pid": os.getpid(),
        "supervisor_start": sf.process_start_ticks(os.getpid()),
        "boot_id": boot_id,
        "adopted": adopt,
    }
    started_clock = sf.boot_clock()
    proc: _Adopted | subprocess.Popen[bytes]
    log_max = int(spec.get("log_max_bytes") or rank_logs.DEFAULT_MAX_BYTES)
    log_keep = int(spec["log_keep"] if spec.get("log_keep") is not None else rank_logs.DEFAULT_KEEP)
    if adopt:
        prev = sf.read_json(lease_dir / sf.SUPERVISOR) or {}
        proc = _Adopted(int(prev["rank_pid"]), prev.get("rank_start"))
        pgid = int(prev.get("pgid") or proc.pid)
        me.update({k: prev.get(k) for k in ("rank_pid", "rank_start", "pgid", "started_at", "started_clock", "cgroup")})
        cgroup = RankCgroup.from_json(prev["cgroup"]) if prev.get("cgroup") else None
        started_clock = float(prev.get("started_clock") or started_clock)
        sf.write_json_atomic(lease_dir / sf.SUPERVISOR, me)
        relay = rank_logs.Relay(lease_dir, log_max, log_keep)  # reads on where the last one stopped
        relay.start()
        _log(f"adopted rank pid {proc.pid}")
    else:
        sf.write_json_atomic(lease_dir / sf.SUPERVISOR, me)
        if not spec.get("cwd"):
            (lease_dir / sf.RANK_DIR).mkdir(exist_ok=True)
        # the logs stay in the agent's private state: the rank gets open descriptors, not paths
        ends = rank_logs.make_pipes(lease_dir)
        relay = rank_logs.Relay(lease_dir, log_max, log_keep)
        user = spec.get("user")  # [uid, gid]: the rank runs as that user, files private to it
        cgroup = None
        ipc: Claim | None = None
        started: subprocess.Popen[bytes] | None = None
        try:
            if spec.get("cgroup"):
                cgroup = _make_cgroup(spec["cgroup"])
                me["cgroup"] = cgroup.as_json()  # an adopting supervisor cleans it up
                sf.write_json_atomic(lease_dir / sf.SUPERVISOR, me)
            if spec.get("ipc"):  # the job's own SysV IPC namespace on this node
                ipc = JobIpc(spec["ipc"]).claim()
            try:
                started = subprocess.Popen(
                    spec["argv"],
                    env=spec["env"],
                    cwd=spec.get("cwd") or str(lease_dir / sf.RANK_DIR),
                    stdin=subprocess.DEVNULL,
                    stdout=ends["stdout"],
                    stderr=ends["stderr"],
                    start_new_session=True,
                    close_fds=True,
                    **_as_user(user, cgroup, _own_mounts(spec), ipc.enter if ipc else None),
                )
            finally:
                why = ipc.pin(started.pid if started is not None else None) if ipc is not None else None
                if why:  # the rank runs on; the job's next rank here makes a namespace of its own
                    _log(f"the job's IPC namespace is not kept for its other ranks: {why}")
            proc = started
        except (OSError, subprocess.SubprocessError) as e:
            for fd in ends.values():
                os.close(fd)
            unfenced = spec.get("cgroup") and cgroup is None  # making its cgroups failed
            what = "cannot fence the rank" if unfenced else f"cannot start {spec['argv'][:1]}"
            relay.write("stderr", f"gpufleet: {what}: {e}\n".encode())
            relay.finish(0.0)
            if cgroup is not None:
                cgroup.remove()
            sf.write_json_atomic(
                lease_dir / sf.EXIT,
                {
                    "state": "EXITED",
                    "exit_code": 127 if isinstance(e, FileNotFoundError) else 126,
                    "signal": None,
                    "error": str(e),
                    "finished_at": time.time(),
                    "boot_id": boot_id,
                },
                fsync=True,
            )
            return 0
        for fd in ends.values():
            os.close(fd)
        relay.start()
        pgid = proc.pid
        me.update(
            {
                "rank_pid": proc.pid,
                "rank_start": sf.process_start_ticks(proc.pid),
                "pgid": pgid,
                "started_at": time.time(),
                "started_clock": started_clock,
            }
        )
        sf.write_json_atomic(lease_dir / sf.SUPERVISOR, me)
        _log(f"started rank pid {proc.pid}: {spec['argv'][:4]}")

    disk = spec.get("disk") or None  # {"limit_bytes", "check_s"}: the rank's work-dir share
    disk_at = sf.boot_clock() + float(disk["check_s"]) if disk else None
    over_disk: dict | None = None  # what it held when it went past its share
    work = spec.get("cwd") or str(lease_dir / sf.RANK_DIR)
    state = None  # why we are ending it: STOPPED | FENCED
    stop_epoch = None
    reason = ""
    kill_at: float | None = None
    killed = False
    stop_path = lease_dir / sf.STOP
    confirmed_path = lease_dir / sf.CONFIRMED

    while proc.poll() is None:
        now = sf.boot_clock()
        if disk and state is None and over_disk is None and disk_at is not None and now >= disk_at:
            limit = int(disk["limit_bytes"])
            used = rank_disk.dir_bytes(work, stop_above=limit)
            now = sf.boot_clock()  # a large dir takes a while
            disk_at = now + float(disk["check_s"])
            if used > limit:
                over_disk = {"used_bytes": used, "limit_bytes": limit}
                kill_at = now + fence_grace_s
                relay.write(
                    "stderr",
                    f"gpufleet: the rank's work dir holds more than its disk share of {limit / (1 << 30):.2f} GiB"
                    f" (its GPUs' share of the node; {used / (1 << 30):.2f} GiB counted): ending it\n".encode(),
                )
                _log(f"work dir past its disk share ({used} > {limit} bytes): SIGTERM")
                _killpg(pgid, signal.SIGTERM)
        if state is None and over_disk is None:
            stop = sf.read_json(stop_path) if stop_path.exists() else None
            if stop is not None:
                state, stop_epoch, reason = "STOPPED", stop.get("epoch"), stop.get("reason", "")
                kill_at = now + max(0.0, float(stop.get("grace_s", 0.0)))
                _log(f"stop requested (epoch {stop_epoch}, grace {stop.get('grace_s')}s): SIGTERM")
                _killpg(pgid, signal.SIGTERM)
            elif flags["term"]:
                state, reason = "STOPPED", "supervisor terminated"
                kill_at = now + fence_grace_s
                _log("supervisor got SIGTERM: SIGTERM to the rank")
                _killpg(pgid, signal.SIGTERM)
            else:
                conf = sf.read_json(confirmed_path)
                last = started_clock
                if conf and conf.get("boot_id") == boot_id:
                    last = max(last, float(conf.get("clock", 0.0)))
                if now - last > unconfirmed_kill_s:
                    state, reason = "FENCED", f"lease unconfirmed for {now - last:.1f}s"
                    kill_at = now + fence_grace_s
                    _log(f"{reason}: SIGTERM")
                    _killpg(pgid, signal.SIGTERM)
        if kill_at is not None and not killed and now >= kill_at:
            _log("grace period over: SIGKILL")
            _killpg(pgid, signal.SIGKILL)
            if kill_argv:
                _run_quiet(kill_argv)
            killed = True
        timeout = poll_s
        if kill_at is not None and not killed:
            timeout = max(0.0, min(timeout, kill_at - now))
        try:
            select.select([rfd], [], [], timeout)
            while os.read(rfd, 512):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    rc = proc.returncode
    # Whatever the leader left behind in its group goes too (GPUs must be free), and in its
    # cgroups whatever left the group.
    _killpg(pgid, signal.SIGKILL)
    oom_kills = 0
    if cgroup is not None:
        cgroup.kill_all()
        oom_kills = cgroup.oom_kills()
        if oom_kills:
            limit = (spec.get("cgroup") or {}).get("memory_bytes") or 0
            relay.write(
                "stderr",
                f"gpufleet: the kernel's out-of-memory killer ended {oom_kills} of the rank's processes: it reached"
                f" its memory limit of {limit / (1 << 30):.1f} GiB (its GPUs' share of the node)\n".encode(),
            )
    if kill_argv and state is not None:
        _run_quiet(kill_argv)
    relay.finish(DRAIN_S)  # all its output is in the logs before exit.json says it ended
    if cgroup is not None and not cgroup.remove():
        _log(f"could not remove the rank's cgroups {cgroup.dirs}")
    progress = sf.read_rank_json(Path(spec["progress"]) if spec.get("progress") else lease_dir / sf.PROGRESS) or {}
    checkpoint = progress.get("checkpoint_uri")
    if "checkpoint_dir" in spec and not (
        isinstance(checkpoint, str) and checkpoint_within(checkpoint, spec["checkpoint_dir"])
    ):
        checkpoint = None  # the agent's rule: a rank cannot point the next attempt outside its dir
    if rc == -255:
        exit_code, sig = None, None
    elif rc is not None and rc < 0:
        exit_code, sig = 128 - rc, -rc
    else:
        exit_code, sig = rc, None
    record = {
        "state": state or "EXITED",
        "exit_code": exit_code,
        "signal": sig,
        "killed": killed,
        "reason": reason,
        "stop_epoch": stop_epoch,
        "checkpoint_uri": checkpoint,
        "checkpoint_step": progress.get("checkpoint_step"),
        "step": progress.get("step"),
        "finished_at": time.time(),
        "boot_id": boot_id,
    }
    if oom_kills:
        record["oom_kills"] = oom_kills
    if over_disk:
        record["disk_exceeded"] = over_disk
    sf.write_json_atomic(lease_dir / sf.EXIT, record, fsync=True)
    _log(f"rank exited: {record}")
    return 0


def _make_cgroup(c: dict) -> RankCgroup:
    return RankCgroup.create(
        c["root"], c["parent"], c["name"], cpus=float(c["cpus"]), memory_bytes=int(c["memory_bytes"]),
        pids=int(c["pids"]), deny_devices=[(int(a), int(b)) for a, b in c.get("deny_devices") or ()],
    )  # fmt: skip


def _own_mounts(spec: dict) -> Callable[[], None] | None:
    """What makes the rank's own mount namespace (worker_agent.rank_mounts), if asked; libc is
    looked up here, before the fork."""
    if not spec.get("private_proc"):
        return None
    mounts = RankMounts()
    tmp = spec.get("private_tmp") or {}
    return lambda: mounts.enter(
        spec.get("mask_file"), list(spec.get("masked_gpus") or ()), tmp.get("dir"), list(tmp.get("keep") or ()),
        spec.get("cwd"), spec.get("shm"),
    )  # fmt: skip


def _as_user(
    user: list[int] | None,
    cgroup: RankCgroup | None,
    own_mounts: Callable[[], None] | None = None,
    own_ipc: Callable[[], None] | None = None,
) -> dict:
    """Popen's arguments that start the rank as ``user`` (private files) inside ``cgroup``,
    in its job's IPC namespace and its own mount namespace if asked. The child joins the
    cgroup and the namespaces first, while it is still root, then drops to the user itself:
    Popen's own ``user=`` would switch before any hook could run."""
    if cgroup is None and own_mounts is None and own_ipc is None:
        return {
            "user": user[0] if user else None,
            "group": user[1] if user else None,
            "extra_groups": [] if user else None,
            "umask": 0o077 if user else -1,
        }

    def join_then_drop() -> None:
        if cgroup is not None:
            cgroup.enter()
        if own_ipc is not None:  # first: its pinned file may lie where the mounts hide
            own_ipc()
        if own_mounts is not None:
            own_mounts()
        if user:
            os.setgroups([])
            os.setgid(user[1])
            os.setuid(user[0])
            os.umask(0o077)

    return {"preexec_fn": join_then_drop}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    adopt = "--adopt" in args
    args = [a for a in args if a != "--adopt"]
    if len(args) != 1:
        sys.stderr.write("usage: python -m worker_agent.supervisor <lease_dir> [--adopt]\n")
        return 2
    lease_dir = Path(args[0])
    # Detach: the agent waits only for this first process; the supervisor lives on
    # in its own session, re-parented to init, whatever happens to the agent.
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    return supervise(lease_dir, adopt=adopt)


if __name__ == "__main__":
    sys.exit(main())
