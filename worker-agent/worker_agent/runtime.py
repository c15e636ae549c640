"""How a rank runs: its environment and the argv its supervisor executes.

* ``ProcessRuntime`` runs ``StartTask.command`` directly (the image is only logged).
* ``ContainerRuntime`` builds a ``docker run --gpus`` / ``podman run --device
  nvidia.com/gpu=N`` command line for production. Environment values never appear
  on the command line (``-e NAME`` takes the value from the engine CLI's
  environment, so they do not show up in ``ps``).

The rank's environment is built from an allowlist of the host's harmless
variables, the job's own ``env`` (without what ``common.contracts.denied_env_key``
names: loader and interpreter hooks, the platform's variables), and ours
(torchrun-compatible ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``; ``GPUFLEET_*`` job variables, with the rank's share of the node's CPUs and
memory when it has one). Nothing of the agent's configuration
or credentials reaches it: no ``GPUFLEET_*`` setting and nothing that looks like a
secret. An isolated rank (``workdir`` given) gets the smaller ``ISOLATED_ALLOWLIST``
of the host's variables, and its work dir as ``HOME`` and ``TMPDIR``.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from common.contracts import StartTask, denied_env_key
from worker_agent.checkpoints import local_path
from worker_agent.rank_limits import MIB, RankLimits

# Host variables a rank may inherit (plus NCCL_*/UCX_* node tuning).
HOST_ALLOWLIST = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ",
    "TMPDIR", "TERM", "LD_LIBRARY_PATH", "CUDA_HOME", "PYTHONPATH",
)  # fmt: skip
HOST_ALLOW_PREFIXES = ("NCCL_", "UCX_")
# what an isolated rank (its own user) keeps of the host's: nothing that points into the agent's world
ISOLATED_ALLOWLIST = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TERM", "LD_LIBRARY_PATH", "CUDA_HOME")
SECRET_LIKE = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|PRIVATE|API_KEY|ACCESS_KEY", re.I)

# Variables the platform owns: the job's env cannot override them.
PLATFORM_VARS = (
    "CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
    "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


def master_port_for(task: StartTask, base: int = 29500, span: int = 20000) -> int:
    """The port the control plane assigned, or a per-lease one (many simulated nodes share a host)."""
    if task.master_port:
        return task.master_port
    return base + zlib.crc32(task.lease_id.encode()) % span


def rank_env(
    task: StartTask,
    *,
    progress_file: str,
    host_env: dict[str, str] | None = None,
    visible_devices: list[int] | None = None,
    workdir: str | None = None,
    limits: RankLimits | None = None,
) -> dict[str, str]:
    host = os.environ if host_env is None else host_env
    allow = ISOLATED_ALLOWLIST if workdir else HOST_ALLOWLIST
    env: dict[str, str] = {}
    for k, v in host.items():
        if (k in allow or k.startswith(HOST_ALLOW_PREFIXES)) and not SECRET_LIKE.search(k):
            env[k] = v
    for k, v in (task.env or {}).items():
        if k in PLATFORM_VARS or denied_env_key(str(k)):
            continue  # ours (set below), or a loader hook the API should have refused
        env[str(k)] = str(v)
    if workdir:
        env["HOME"] = env["TMPDIR"] = workdir
    devices = task.gpu_indices if visible_devices is None else visible_devices
    env.update(
        {
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in devices),
            "RANK": str(task.rank),
            "WORLD_SIZE": str(task.world_size),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(task.rank),
            "NODE_RANK": str(task.rank),
            "MASTER_ADDR": task.master_addr,
            "MASTER_PORT": str(master_port_for(task)),
            "GPUFLEET_JOB_ID": task.job_id,
            "GPUFLEET_ATTEMPT": str(task.attempt),
            "GPUFLEET_LEASE_ID": task.lease_id,
            "GPUFLEET_CHECKPOINT_DIR": task.checkpoint_dir or "",
            "GPUFLEET_PROGRESS_FILE": progress_file,
        }
    )
    if task.resume_from:
        env["GPUFLEET_RESUME_FROM"] = task.resume_from
    if limits is not None:  # its share of the node: size worker pools by this, not os.cpu_count()
        env["GPUFLEET_CPUS"] = f"{limits.cpus:g}"
        env["GPUFLEET_MEMORY_BYTES"] = str(limits.memory_bytes)
        if limits.disk_bytes:
            env["GPUFLEET_DISK_BYTES"] = str(limits.disk_bytes)  # in its work dir ($HOME, $TMPDIR)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@dataclass(frozen=True)
class Launch:
    """What the supervisor executes: argv, its environment, and how to force-kill it."""

    argv: list[str]
    env: dict[str, str]
    kill_argv: list[str]


class ProcessRuntime:
    name = "process"

    def launch(
        self,
        task: StartTask,
        *,
        progress_file: str,
        host_env: dict[str, str] | None = None,
        workdir: str | None = None,
        user: tuple[int, int] | None = None,
        limits: RankLimits | None = None,
    ) -> Launch:
        """``user``: the supervisor starts the rank as that uid/gid (spec ``user``); ``limits``
        are the supervisor's to apply (spec ``cgroup``, when the agent has cgroups)."""
        env = rank_env(
            task, progress_file=progress_file, host_env=host_env, workdir=workdir if user else None, limits=limits
        )
        return Launch(list(task.command), env, [])

    def cached_images(self) -> list[str]:
        return []

    def problem(self) -> str | None:
        """What keeps this runtime from starting ranks now (worker_agent.node_fitness): nothing
        of its own; the rank's command is the job's."""
        return None


class ContainerRuntime:
    """``docker run`` / ``podman run`` command lines (no engine runs in tests)."""

    def __init__(self, engine: str = "docker", *, extra_args: list[str] | None = None) -> None:
        if engine not in ("docker", "podman"):
            raise ValueError(f"unknown container engine {engine!r}")
        self.name = engine
        self.engine = engine
        self.extra_args = list(extra_args or [])

    @staticmethod
    def container_name(task: StartTask) -> str:
        return "gpufleet-" + re.sub(r"[^A-Za-z0-9_.-]", "-", task.lease_id)

    def launch(
        self,
        task: StartTask,
        *,
        progress_file: str,
        host_env: dict[str, str] | None = None,
        workdir: str | None = None,
        user: tuple[int, int] | None = None,
        limits: RankLimits | None = None,
    ) -> Launch:
        """The container runs as ``user`` (``--user uid:gid``) and sees only its own work dir
        and checkpoint paths, never the agent's state. ``limits``: its share of the node's CPUs,
        memory (no swap; /dev/shm counts in it) and processes."""
        if not task.image:
            raise ValueError("the container runtime needs StartTask.image")
        # Inside the container the granted GPUs are numbered from 0.
        inner = rank_env(
            task, progress_file=progress_file, host_env=host_env, visible_devices=list(range(len(task.gpu_indices))),
            limits=limits,
        )  # fmt: skip
        for k in ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "PYTHONPATH", "LD_LIBRARY_PATH", "TMPDIR"):
            inner.pop(k, None)  # the image's own
        name = self.container_name(task)
        devices = ",".join(str(g) for g in task.gpu_indices)
        argv = [
            self.engine, "run", "--rm", "--init", "--name", name,
            "--label", f"gpufleet.lease={task.lease_id}",
            "--label", f"gpufleet.job={task.job_id}",
            "--label", f"gpufleet.attempt={task.attempt}",
            # host network for NCCL; a private IPC namespace: another tenant's container on the
            # node must not see this one's /dev/shm or SysV segments (a rank's processes share it)
            "--network", "host", "--ipc", "private",
            "--security-opt", "no-new-privileges",
            "--stop-signal", "SIGTERM",
        ]  # fmt: skip
        if limits is not None:
            memory = f"{limits.memory_bytes // MIB}m"
            argv += [
                "--cpus", f"{limits.cpus:g}",
                "--memory", memory, "--memory-swap", memory, "--shm-size", memory,
                "--pids-limit", str(limits.pids),
            ]  # fmt: skip
        if user is not None:
            argv += ["--user", f"{user[0]}:{user[1]}"]
        if self.engine == "docker":
            argv += ["--gpus", f'"device={devices}"'] if task.gpu_indices else []
        else:
            for g in task.gpu_indices:
                argv += ["--device", f"nvidia.com/gpu={g}"]
        mounts: list[str] = [str(Path(progress_file).parent)]
        for uri in (task.checkpoint_dir, task.resume_from):
            local = local_path(uri)
            if local and not any(local == m or local.startswith(m.rstrip("/") + "/") for m in mounts):
                mounts.append(local.rstrip("/") or "/")
        for m in mounts:
            argv += ["-v", f"{m}:{m}"]
        for k in sorted(inner):
            argv += ["-e", k]
        argv += self.extra_args
        argv += [task.image, *task.command]
        # The engine CLI process carries the values for `-e NAME`.
        cli_env = {k: v for k, v in (os.environ if host_env is None else host_env).items() if k in ("PATH", "HOME")}
        cli_env.update(inner)
        return Launch(argv, cli_env, [self.engine, "kill", "--signal", "KILL", name])

    def cached_images(self) -> list[str]:
        import subprocess

        try:
            out = subprocess.run(
                [self.engine, "images", "--format", "{{.Repository}}:{{.Tag}}"],
                capture_output=True, text=True, timeout=10, check=False,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return []
        return sorted({line.strip() for line in out.stdout.splitlines() if line.strip() and "<none>" not in line})

    def problem(self, timeout_s: float = 10.0) -> str | None:
        """Whether the engine answers (``<engine> info``): a daemon that is down or hung fails
        every rank's ``run`` (exit 125, or 127 with no engine), which would read as the job's
        own failure. None when it answers."""
        import subprocess

        argv = [self.engine, "info", "--format", "{{.ServerVersion}}"]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        except FileNotFoundError:
            return f"container engine {self.engine}: not installed"
        except subprocess.TimeoutExpired:
            return f"container engine {self.engine}: no answer to `{self.engine} info` within {timeout_s:g}s"
        except OSError as e:
            return f"container engine {self.engine}: {e}"
        if r.returncode != 0:
            said = (r.stderr.strip() or r.stdout.strip()).splitlines()
            return f"container engine {self.engine}: {said[-1][:300] if said else f'exit {r.returncode}'}"
        return None


def make_runtime(settings) -> ProcessRuntime | ContainerRuntime:
    if settings.agent_runtime == "container":
        return ContainerRuntime(settings.agent_container_engine)
    return ProcessRuntime()
