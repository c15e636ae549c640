"""All of gpufleet's settings in one place (environment prefix ``GPUFLEET_``).

Every duration is a setting so tests can run leases, heartbeats and grace
periods in seconds. Pydantic lives here and at the HTTP edge only.

A secret (``SECRET_FIELDS``) may also come from a file: ``GPUFLEET_<NAME>_FILE=path``
reads the value from ``path``, which must be a regular file owned by this process's user
and readable by nobody else (mode 0600 or stricter). Which process gets which secret, and
what a production start refuses, is ``common.secrets``.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from common.image_ref import parse_registry_rule

# the settings that are secrets (never logged, never handed to a process that does not use them)
SECRET_FIELDS = (
    "database_url",
    "api_tokens",
    "agent_credentials",
    "agent_log_keys",
    "agent_shared_secret",
    "log_signing_key",
    "token",
)


class SecretFileError(ValueError):
    """A ``GPUFLEET_<NAME>_FILE`` that cannot be used as a secret."""


def read_secret_file(path: str, name: str) -> str:
    """A secret's value from ``path``: a regular file owned by this user, mode 0600 or stricter."""
    var = f"GPUFLEET_{name.upper()}_FILE"
    try:
        st = os.stat(path)
    except OSError as e:
        raise SecretFileError(f"{var}={path}: {e.strerror}") from e
    import stat

    if not stat.S_ISREG(st.st_mode):
        raise SecretFileError(f"{var}={path}: not a regular file")
    if st.st_uid != os.geteuid():
        raise SecretFileError(f"{var}={path}: owned by uid {st.st_uid}, not by this process's user ({os.geteuid()})")
    if st.st_mode & 0o077:
        raise SecretFileError(f"{var}={path}: mode {stat.S_IMODE(st.st_mode):o} lets others read it; use 0600")
    return Path(path).read_text().strip()


class _SecretFiles(PydanticBaseSettingsSource):
    """``GPUFLEET_<NAME>_FILE`` for every secret: the value read from that file (JSON for maps)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[object, str, bool]:
        return None, field_name, False  # everything is read in __call__

    def __call__(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for name in SECRET_FIELDS:
            path = os.environ.get(f"GPUFLEET_{name.upper()}_FILE")
            if path:
                text = read_secret_file(path, name)
                out[name] = json.loads(text) if name in ("api_tokens", "agent_credentials", "agent_log_keys") else text
        return out


class Principal(BaseModel):
    """Who a bearer token stands for: a member of one team, or an admin."""

    name: str
    team: str | None = None
    admin: bool = False


# settings renamed when their meaning changed: one still set is refused with the new name,
# not ignored (an operator's value would silently stop applying)
RENAMED = {
    "GPUFLEET_AGENT_TEAM_UID_BASE": (
        "GPUFLEET_AGENT_RANK_ID_BASE (each job's ranks now run as uid base + the job's number, gid base + the team's)"
    ),
}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUFLEET_", env_nested_delimiter="__", extra="ignore")

    @model_validator(mode="after")
    def _no_renamed_setting(self) -> Settings:
        for old, new in RENAMED.items():
            if old in os.environ:
                raise ValueError(f"{old} was renamed {new}: set that instead, and unset {old}")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # arguments first, then the environment, then GPUFLEET_<NAME>_FILE secrets
        return init_settings, env_settings, _SecretFiles(settings_cls), dotenv_settings

    # --- which deployment -----------------------------------------------------
    env: Literal["dev", "production"] = Field(
        "production",
        description="dev allows the built-in dev secrets (`gpufleet up`, tests); production refuses to start with one",
    )

    # --- where things live -------------------------------------------------
    state_dir: Path = Field(Path(".gpufleet"), description="state of the embedded services and agents")
    database_url: str | None = Field(None, description="external Postgres; unset = embedded pgserver")
    temporal_address: str | None = Field(None, description="external Temporal frontend; unset = embedded dev server")
    temporal_namespace: str = Field("default", description="Temporal namespace")
    temporal_tls: bool = Field(
        False, description="connect to Temporal over TLS (Temporal Cloud, or a frontend with its own certificate)"
    )
    temporal_tls_ca_file: Path | None = Field(
        None, description="the CA Temporal's certificate is checked against (unset: the system's trust store)"
    )
    temporal_tls_cert_file: Path | None = Field(
        None, description="a client certificate for mutual TLS with Temporal (PEM, with its chain; Cloud's mTLS)"
    )
    temporal_tls_key_file: Path | None = Field(None, description="the key of temporal_tls_cert_file (PEM)")
    temporal_tls_server_name: str | None = Field(
        None, description="the name Temporal's certificate must carry, when not the address's host"
    )
    temporal_port: int = Field(7233, description="embedded Temporal dev server frontend port")
    temporal_ui_port: int = Field(8233, description="embedded Temporal Web UI port")
    db_pool_min: int = Field(1, description="asyncpg pool minimum connections")
    db_pool_max: int = Field(10, description="asyncpg pool maximum connections")
    db_command_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a statement (BEGIN and COMMIT too) Postgres has not answered in this long fails, and its"
        " connection leaves the pool: one to a database host that vanished (no reset, as after a power loss or a"
        " failover to another host) otherwise waits for ever. A dead connection costs up to twice this (asyncpg"
        " then waits as long for the cancellation), which stays within a client's 30 s of retries. Not applied"
        " to migrations",
    )
    db_idle_in_transaction_s: float = Field(
        60.0,
        gt=0,
        description="Postgres ends a session of gpufleet's that sits idle inside a transaction this long, and"
        " releases its locks: one whose client was cut off by a partition would otherwise hold them until TCP"
        " keepalive gave up (over 2 h by default). gpufleet's transactions wait on nothing but Postgres",
    )

    # --- processes ---------------------------------------------------------
    api_host: str = Field("127.0.0.1", description="API listen address")
    api_port: int = Field(8000, description="API listen port")
    api_reuse_port: bool = Field(
        False,
        description="bind the API's port with SO_REUSEPORT, so several `gpufleet api` processes share one address"
        " (the kernel spreads connections across them; one dying leaves the others serving)",
    )
    control_task_queue: str = Field(
        "gpufleet-control", description="task queue of JobWorkflow, BurnInWorkflow and their control activities"
    )
    control_job_workers: int = Field(
        1,
        ge=0,
        le=64,
        description="child processes of `control` that run job workflows (0: the control process runs them itself)",
    )
    control_cached_workflows: int = Field(
        4000, ge=10, description="workflow runs a control worker keeps in memory (sticky cache)"
    )
    control_grpc_host: str = Field("127.0.0.1", description="control gRPC listen address (agent heartbeats)")
    control_grpc_port: int = Field(50051, description="control gRPC listen port")
    control_tls: bool = Field(
        False,
        description="agents and control speak TLS on the gRPC link (control serves control_tls_cert_file; agents"
        " check it against tls_ca_file)",
    )
    control_tls_cert_file: Path | None = Field(None, description="control's gRPC certificate (PEM, with its chain)")
    control_tls_key_file: Path | None = Field(None, description="the key of control_tls_cert_file (PEM)")
    control_addresses: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:50051"], description="every control gRPC address, for agents"
    )
    agent_task_queue_prefix: str = Field("gpufleet-node-", description="a node's task queue is this prefix + node id")
    agent_simulate: int = Field(16, description="simulated nodes hosted by `make up`'s agent process")
    agent_nvml_backend: Literal["real", "simulated"] = Field(
        "simulated", description="GPU health source: real NVML or the simulated backend"
    )
    agent_credentials: dict[str, str] = Field(
        default_factory=dict, description="node_id -> credential, for the nodes an agent process hosts"
    )
    agent_log_keys: dict[str, str] = Field(
        default_factory=dict,
        description="node_id -> the key that node's log endpoint checks tokens with (issued with its credential)",
    )
    node_credentials_refresh_s: float = Field(
        10.0,
        gt=0,
        description="control re-reads the issued node credentials this often (a revocation takes effect within it)",
    )
    agent_shared_secret: str = Field(
        "dev-agent-secret",
        description="derives every node's credential (dev only; production issues per-node credentials)",
    )

    # --- leadership (docs/design.md, Leadership) --------------------------------
    leader_scope: str = Field("placement", description="leader row scope")
    leader_renew_s: float = Field(5.0, description="leader lease renewal interval")
    leader_ttl_s: float = Field(15.0, description="leader lease lifetime after its last renewal")
    takeover_quiet_s: float = Field(30.0, description="no node marked suspect this long after takeover")

    # --- placement ----------------------------------------------------------
    placement_cycle_s: float = Field(1.0, description="placement cycle interval (also runs when woken)")
    placement_lookahead: int = Field(2000, description="queued jobs considered per cycle")
    hot_spare_fraction: float = Field(0.015, description="nodes kept free per large reservation for restarts")
    preemption_protect_s: float = Field(1800.0, description="no preemption this soon after a job starts")
    preemption_daily_budget: int = Field(
        3, description="after this many preemptions in 24 h a job loses only borrowed capacity"
    )
    claim_borrowed_reservations_after_s: float = Field(
        300.0,
        ge=0,
        description="guaranteed work that waited this long may use nodes a borrowing gang reserved (inf: never)",
    )
    reclaim_small_borrowed_after_s: float = Field(
        300.0,
        ge=0,
        description="guaranteed work that waited this long may reclaim small borrowed jobs of higher classes (inf: never)",
    )
    spares_yield_after_s: float | None = Field(
        None,
        ge=0,
        description="guaranteed work that waited this long and fits nowhere else may take large gangs' hot spare"
        " nodes, only those it needs. null: off (docs/design.md, Placement: tried, left off)",
    )
    borrowed_gang_guard: float | None = Field(
        0.5,
        ge=0,
        description="a whole-node gang of the reservation size or more (placement.Policy.reserve_min_gpus), or any"
        " job of at most 1% of its GPU type (a prod-batch job only for its first 60 s), beyond its"
        " team's guarantee starts only on free GPUs that leave this share"
        " of the guaranteed demand other teams are expected to want back (recent peaks); it then waits rather than"
        " reclaim or reserve. null: off (docs/design.md, Placement: less churn)",
    )
    borrowed_restart_backoff_s: float | None = Field(
        1800.0,
        ge=0,
        description="a job preempted n times in 24 h starts beyond its team's guarantee again only n x this long"
        " after its last preemption, unless the free GPUs left cover the guaranteed demand expected back."
        " null: off (docs/design.md, Placement: less churn)",
    )
    pooled_demand_forecast: bool = Field(
        True,
        description="the borrow guards expect back the teams' combined recent peak demand within their guarantees,"
        " not the sum of each team's own peak (docs/design.md, Placement: less churn)",
    )
    fair_share_half_life_h: float = Field(84.0, description="half-life of decayed GPU-hour usage (7-day window)")

    # --- jobs (docs/design.md, Job lifecycle) ------------------------------------
    gang_start_timeout_s: float = Field(600.0, description="a gang not fully started in this time is released")
    default_grace_s: float = Field(30.0, description="checkpoint grace period when a job names none")
    max_runtime_caps_s: dict[str, float] = Field(
        description="longest max_runtime per priority class",
        default_factory=lambda: {
            "prod-serving": 90 * 24 * 3600.0,
            "prod-batch": 14 * 24 * 3600.0,
            "research": 7 * 24 * 3600.0,
            "preemptible": 3 * 24 * 3600.0,
        },
    )
    max_extensions: int = Field(2, description="runtime extensions per job")
    max_extension_fraction: float = Field(
        0.25, description="each extension at most this fraction of the original max_runtime"
    )
    max_failed_attempts: int = Field(3, description="failed attempts (caused by the job) in 24 h before FAILED")
    failure_window_s: float = Field(24 * 3600.0, description="window in which max_failed_attempts are counted")
    start_task_timeout_s: float = Field(
        60.0, description="one StartTask/StopTask activity try (the gang timeout bounds all tries)"
    )
    stop_margin_s: float = Field(
        10.0, description="after a stop's grace period, how long to wait for the agents' exit reports"
    )
    strict_job_transitions: bool = Field(
        False,
        description="a job state change outside placement.lifecycle's table fails (the tests set it) instead of being logged",
    )
    test_faults: list[Literal["ack_before_durable", "skip_epoch_check"]] = Field(
        default_factory=list,
        description="deliberate breakages, for the chaos checker's own tests: ack_before_durable (control acks a"
        " report before it is stored), skip_epoch_check (allocation writes ignore the epoch); dev only",
    )
    allocation_resignal_s: float = Field(
        5.0, description="retry an allocation or preemption signal that Temporal did not accept after this (doubling)"
    )
    connect_retry_max_s: float = Field(
        10.0,
        gt=0,
        description="a control process started while Postgres or Temporal is unreachable waits for it, retrying"
        " at most this far apart (it does not exit)",
    )
    signal_timeout_s: float = Field(
        30.0,
        gt=0,
        description="the leader gives up on an allocation or preemption signal Temporal has not answered in this"
        " (then re-sends it); a job is not re-sent while a send is unanswered",
    )
    report_delivery_poll_s: float = Field(
        1.0, gt=0, description="the leader looks for stored agent reports not yet in their job's workflow this often"
    )
    job_search_attributes: bool = Field(
        True,
        description="job workflows carry team, class, GPU type, GPUs, state and attempt as Temporal search attributes"
        " (filterable in the UI; costs the server a visibility write per state change)",
    )
    workflow_reconcile_s: float = Field(
        60.0,
        gt=0,
        description="every placed job (not QUEUED) is checked for a running workflow this often (one is started when missing)",
    )
    wake_check_s: float = Field(
        10.0,
        gt=0,
        description="a control checks its LISTEN connection for wake-ups this often, and listens on a fresh one"
        " when it has closed or stopped answering (a Postgres restart, failover or lost host)",
    )
    placement_wake_min_s: float = Field(
        0.1, description="least time between two placement cycles (a burst of changes runs one cycle)"
    )

    # --- observability (docs/design.md, Observability) ---------------------------
    control_metrics_listen: str = Field(
        "127.0.0.1:9101",
        description="where a control process serves Prometheus /metrics (host:port; port 0 = any free port)",
    )
    gpu_hour_usd: float = Field(
        2.08, ge=0, description="what one GPU-hour costs, for the idle-cost metrics ($1.2M/day over 24,000 GPUs)"
    )
    idle_gpu_util_pct: float = Field(
        5.0, ge=0, le=100, description="a lease whose GPUs' mean SM use stays below this is idle"
    )
    idle_gpu_after_s: float = Field(
        600.0, gt=0, description="below idle_gpu_util_pct this long: the lease is allocated-but-idle"
    )
    gpu_use_flush_s: float = Field(
        15.0, gt=0, description="how often the leader writes the leases' GPU use and idle marks to Postgres"
    )

    # --- health (docs/design.md, Health) -----------------------------------------
    heartbeat_interval_s: float = Field(5.0, description="agent heartbeat interval")
    suspect_after_s: float = Field(30.0, description="no heartbeat this long: node suspect")
    down_after_s: float = Field(90.0, description="no heartbeat this long: node down")
    unconfirmed_kill_s: float = Field(
        900.0, description="a rank whose lease is unconfirmed this long is killed by its supervisor"
    )
    fence_margin: float = Field(1.5, description="a silent node's GPUs are reused after unconfirmed_kill_s times this")
    hang_after_s: float = Field(600.0, description="step counter stalled this long with idle GPUs: hang")
    missing_task_release_s: float = Field(120.0, description="a lease whose task is missing this long is released")
    health_sweep_s: float = Field(
        1.0, description="the leader's health sweep interval (silence, recovery re-signals, restart clock)"
    )
    node_blame_min_jobs: int | None = Field(
        3,
        ge=1,
        description="a ready node where the attempts of this many jobs failed first, each of which then ran elsewhere"
        " (succeeded, or runs on other nodes for node_blame_ran_s), since the node entered service, is cordoned for"
        " burn-in (a fault no check sees); null: never",
    )
    node_blame_min_teams: int = Field(
        2,
        ge=1,
        description="... and those jobs are of at least this many teams (one team's broken sweep is not enough)",
    )
    node_blame_window_s: float = Field(
        3600.0, gt=0, description="only failed attempts this recent count against a node (node_blame_min_jobs)"
    )
    node_blame_ran_s: float = Field(
        600.0, ge=0, description="a job's attempt that still runs elsewhere counts once it has run this long"
    )
    node_blame_check_s: float = Field(60.0, gt=0, description="how often the leader reads that evidence")
    health_mass_silence_fraction: float = Field(
        0.2,
        gt=0,
        le=1,
        description="when this share of the nodes in service is silent at once, the leader marks none down and"
        " recovers no job for silence (the mass-silence guard; released below half of it)",
    )
    health_mass_silence_min_nodes: int = Field(
        3, ge=1, description="the mass-silence guard engages only when at least this many nodes are silent"
    )
    ib_flap_threshold: int = Field(
        5, description="InfiniBand link flaps reported in one heartbeat that cordon the node"
    )
    hang_idle_util_pct: float = Field(
        1.0, description="GPU use at or below this percent counts as idle for hang detection"
    )
    recovery_resignal_s: float = Field(
        5.0, description="re-send node_failed to a job while its lease on a failed node is live"
    )
    burn_in_timeout_s: float = Field(900.0, description="a burn-in not passed within this is failed")
    burn_in_retry_s: float = Field(300.0, description="after a failed burn-in, wait this long before the next")
    burn_in_seconds: float = Field(60.0, description="how long the burn-in stress test runs (matmul + NCCL all-reduce)")

    # --- agent (worker-agent; docs/design.md, Processes and Health) ---------------
    agent_node_id: str | None = Field(
        None, description="node id of `gpufleet agent run` without --nodes/--simulate; unset = hostname"
    )
    agent_runtime: Literal["process", "container"] = Field(
        "process", description="how ranks run: the command directly, or under agent_container_engine"
    )
    agent_container_engine: Literal["docker", "podman"] = Field(
        "docker", description="container engine of the container runtime"
    )
    agent_task_queue_mode: Literal["per_node", "shared"] = Field(
        "per_node",
        description="per_node: a Temporal worker per node task queue; shared: one worker on agent_shared_task_queue routing by node id (large simulated fleets; callers must use that queue)",
    )
    agent_shared_task_queue: str = Field(
        "gpufleet-nodes-shared", description="the one node task queue when agent_task_queue_mode is shared"
    )
    agent_http_listen: str = Field(
        "127.0.0.1:0",
        description="where an agent process serves rank logs to the API over HTTP (GET /v1/leases/{id}/logs; host:port, port 0 = any; advertised in heartbeats as agent_addr)",
    )
    agent_rank_isolation: bool = Field(
        True,
        description="ranks run as an unprivileged user, in their own work dir (needs the agent to run as root; else it says so)",
    )
    agent_rank_uid: int = Field(
        65534,
        ge=1,
        description="the numeric user ranks run as when their job has no user of its own (burn-in; every job"
        " when agent_rank_id_base is 0); no account needed",
    )
    agent_rank_gid: int = Field(65534, ge=1, description="the numeric group those ranks run as")
    agent_rank_id_base: int = Field(
        2_000_000_000,
        ge=0,
        le=2_100_000_000,
        description="each job's ranks run as uid agent_rank_id_base + the job's number in the store (jobs.rank_id)"
        " and gid agent_rank_id_base + its team's (teams.rank_id), so two jobs' ranks on one node cannot read or"
        " signal each other; the range up to 2147483646 must be free of the hosts' users (and their subuid"
        " ranges); 0: every job runs as agent_rank_uid/gid",
    )
    agent_team_rank_ids: dict[str, tuple[int, int]] = Field(
        default_factory=dict,
        description="team -> [uid, gid] its jobs' ranks run as, in place of the numbered users (an account of the"
        " team's on shared storage, for example; its jobs then share that user)",
    )
    agent_rank_limits: bool = Field(
        True,
        description="fence each rank to its share of the node: CPUs, memory, processes and work-dir disk in"
        " proportion to its GPUs, after the node's reserve (the container engine's flags, or cgroups under the"
        " process runtime when agent_rank_cgroups; disk measured by the rank's supervisor)",
    )
    agent_rank_private_proc: bool = Field(
        True,
        description="under the process runtime, as root, each rank starts in its own mount namespace with /proc"
        " mounted hidepid=2, so it sees only its own user's processes, not other jobs' command lines (Linux 5.8+;"
        " the agent says at start when it cannot); where no cgroup denies a rank the GPUs beside its own, the"
        " namespace also masks their device nodes",
    )
    agent_rank_private_tmp: bool = Field(
        True,
        description="in that namespace, a rank's /tmp and /var/tmp are one dir in its work dir: what it writes"
        " there counts against its disk share and no other job sees it or plants a file there; paths it needs"
        " under them (its work dir, checkpoint dir, the GPU device dir) stay reachable at the same paths",
    )
    agent_rank_private_shm: bool = Field(
        True,
        description="in that namespace, a rank's /dev/shm is its job's own tmpfs (shared by the job's ranks on the"
        " node, as NCCL needs), sized to their memory share (the host's /dev/shm's size with agent_rank_limits"
        " off), so no other job lists or opens its segments and none can fill the /dev/shm the node's other jobs"
        " use; the agent unmounts it once the job's last rank on the node has ended, giving back the shared"
        " memory a killed rank leaves",
    )
    agent_rank_private_ipc: bool = Field(
        True,
        description="in that namespace, a rank's System V IPC (shared memory, semaphores, message queues) is its"
        " job's own namespace on the node, shared by the job's ranks there, so no other job lists or opens its"
        " objects; the agent lets it go once the job's last rank on the node has ended, and every object in it"
        " with it",
    )
    agent_rank_cgroups: bool = Field(
        False,
        description="under the process runtime, put each rank in its own cgroups with its share's limits and kill"
        " every process left in them when it ends (needs root and cgroups; off by default because `make up`'s"
        " simulated nodes share one host)",
    )
    agent_cgroup_root: Path = Field(Path("/sys/fs/cgroup"), description="where the cgroup hierarchies are mounted")
    agent_cgroup_parent: str = Field(
        "gpufleet",
        pattern=r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$",
        description="the cgroup (a path under agent_cgroup_root; with cgroup v2, a subtree delegated to the agent)"
        " under which each rank gets its own",
    )
    agent_gpu_device_dir: Path = Field(
        Path("/dev"),
        description="where the node's GPU device nodes (nvidiaN) are: with agent_rank_cgroups on cgroup v1, a rank"
        " is denied every one but its own GPUs'",
    )
    agent_rank_firewall: Literal["auto", "required", "off"] = Field(
        "auto",
        description="keep ranks off the control plane: nftables rules reject TCP connections from the ranks' users"
        " to Temporal, control's gRPC and agent_rank_blocked_addresses (auto: where nft is installed, else the agent"
        " says at start that ranks can reach them; required: refuse to start without)",
    )
    agent_rank_blocked_addresses: list[str] = Field(
        default_factory=list,
        description="more host:port that ranks may not connect to (Postgres, Temporal's UI, metrics), beside"
        " Temporal's and control's",
    )
    agent_rank_firewall_refresh_s: float = Field(
        60.0,
        gt=0,
        description="how often the agent resolves those addresses again and closes any new one to ranks: a name"
        " that moved to another address, or could not be resolved at start (an address once closed stays closed"
        " while the agent runs); a table gone from the host (a flushed ruleset) is put back then",
    )
    agent_rank_firewall_table: str = Field(
        "gpufleet_ranks",
        pattern=r"^[a-z][a-z0-9_]{0,30}$",
        description="the nftables table (inet) of those rules, with a hash of the state dir after it (<name>_<hash>):"
        " two stacks on one host keep their own",
    )
    agent_node_cpus: float | None = Field(
        None, gt=0, description="the node's CPUs for rank shares (unset: the CPUs this agent may run on)"
    )
    agent_node_memory_gib: float | None = Field(
        None, gt=0, description="the node's memory for rank shares (unset: this host's)"
    )
    agent_node_reserved_cpus: float = Field(
        2.0, ge=0, description="CPUs kept for the agent, the supervisors and the OS before ranks share the rest"
    )
    agent_node_reserved_memory_gib: float = Field(
        8.0, ge=0, description="memory kept for the agent, the supervisors and the OS before ranks share the rest"
    )
    agent_rank_pids_max: int = Field(16384, ge=64, description="processes and threads one rank may have at once")
    agent_node_disk_gib: float | None = Field(
        None, gt=0, description="the disk ranks' work dirs share (unset: the size of their filesystem)"
    )
    agent_node_reserved_disk_gib: float = Field(
        100.0, ge=0, description="disk of the work dirs' filesystem kept for images, logs and the OS"
    )
    agent_min_free_disk_bytes: int = Field(
        1 << 30,
        ge=0,
        description="free disk the node's state dir and ranks' work dir keep, below which the agent reports the"
        " node unfit for new ranks (its running ranks go on)",
    )
    agent_node_fitness_check_s: float = Field(
        30.0,
        gt=0,
        description="how often the agent checks that the node can host new ranks (those dirs written, fsynced and"
        " above agent_min_free_disk_bytes; the container engine answering); also at the next heartbeat after a start"
        " that could not prepare its dirs",
    )
    agent_rank_disk_check_s: float = Field(
        30.0,
        gt=0,
        description="how often a rank's supervisor measures its work dir; a rank past its disk share is ended"
        " (SIGTERM, then SIGKILL after agent_fence_grace_s) and its stderr says why",
    )
    agent_work_dir: Path | None = Field(
        None, description="where ranks' working dirs live, outside the agent's state (unset: <state_dir>/work)"
    )
    agent_poll_s: float = Field(
        0.5, description="how often agents and rank supervisors check exits, steps, stop requests and confirmations"
    )
    agent_ack_timeout_s: float = Field(
        5.0,
        gt=0,
        description="a heartbeat the control process has not acknowledged within this ends the agent's stream: it"
        " tries the next control address (also its gRPC keepalive timeout)",
    )
    agent_connect_timeout_s: float = Field(
        5.0, gt=0, description="an agent gives up a control address that does not connect within this"
    )
    agent_fence_grace_s: float = Field(
        30.0, description="SIGTERM to SIGKILL when a supervisor kills a rank whose lease went unconfirmed"
    )
    agent_log_max_bytes: int = Field(
        256 * 1024 * 1024,
        ge=64 * 1024,
        description="the most disk one lease's rank output takes (its timestamped record log, which `gpufleet"
        " logs` reads, half; stdout.log and stderr.log a quarter each); past it the oldest is dropped",
    )
    agent_log_keep: int = Field(
        3,
        ge=0,
        le=100,
        description="rotated files kept per lease log besides the one written (each log's share of"
        " agent_log_max_bytes is split among them)",
    )
    fatal_xids: list[int] = Field(
        default_factory=lambda: [48, 63, 64, 74, 79, 94, 95],
        description="Xid errors that mark a GPU failed (cordon at once)",
    )

    # --- API ----------------------------------------------------------------
    api_tokens: dict[str, Principal] = Field(default_factory=dict, description="bearer token -> principal")
    allowed_registries: list[str] = Field(
        description="registries jobs may pull from: host[:port], optionally /repository/prefix (matched by"
        " component, not as text)",
        default_factory=lambda: ["registry"],
    )
    api_requests_per_s_per_principal: int = Field(
        200, ge=1, description="requests a second one principal may make to one API process (over 10 s), then 429"
    )
    api_requests_per_s_per_address: int = Field(
        500, ge=1, description="requests a second one client address may make to one API process (over 10 s), then 429"
    )
    api_auth_failures_per_minute: int = Field(
        30, ge=1, description="requests with a bad or missing token from one address a minute, then 429 until it eases"
    )
    max_queued_per_team: int = Field(5000, description="admission: queued jobs per team")
    max_page_size: int = Field(500, description="largest list page")
    max_request_bytes: int = Field(1_000_000, description="largest request body")
    idempotency_ttl_s: float = Field(24 * 3600.0, description="how long idempotency keys are kept")
    idempotency_wait_s: float = Field(
        0.5, description="a retry waits this long for an in-flight first request, then 409"
    )
    default_page_size: int = Field(50, description="list page size when the request gives none")
    api_temporal_timeout_s: float = Field(
        5.0, description="API calls to Temporal (start, signal, update) give up after this"
    )
    log_signing_key: str = Field(
        "dev-log-signing-key",
        description="the API's key for the short-lived per-lease log tokens; each node gets a key derived from it",
    )
    log_token_ttl_s: float = Field(60.0, gt=0, description="how long a per-lease log token is valid")
    api_url: str | None = Field(
        None,
        description="where the CLI reaches the API; unset = http://api_host:api_port (https:// with api_tls_cert_file)",
    )
    api_tls_cert_file: Path | None = Field(
        None, description="the API serves HTTPS with this certificate (PEM, with its chain); unset: plain HTTP"
    )
    api_tls_key_file: Path | None = Field(None, description="the key of api_tls_cert_file (PEM)")
    agent_tls_cert_file: Path | None = Field(
        None,
        description="an agent serves rank logs over HTTPS with this certificate (PEM; its name must be the host it"
        " advertises) and advertises https://; unset: plain HTTP",
    )
    agent_tls_key_file: Path | None = Field(None, description="the key of agent_tls_cert_file (PEM)")
    tls_ca_file: Path | None = Field(
        None,
        description="the CA the platform's clients check its servers' certificates against (the CLI the API's, the"
        " API agents', agents control's); unset: the system's trust store",
    )
    token: str | None = Field(None, description="the CLI's bearer token")
    client_retry_s: float = Field(
        30.0,
        ge=0,
        description="the CLI retries a request that reached no API (connection refused or reset, 502/503/504, its"
        " Idempotency-Key still in flight) with backoff for this long, with the same key, then gives up",
    )

    # --- demo cluster seeded by `make up` -----------------------------------
    demo_blocks: int = Field(4, description="demo cluster: blocks")
    demo_nodes_per_block: int = Field(4, description="demo cluster: nodes per block")
    demo_gpus_per_node: int = Field(8, description="demo cluster: GPUs per node")
    demo_gpu_type: str = Field("h100", description="demo cluster: GPU type")

    @field_validator("state_dir")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    @field_validator("allowed_registries")
    @classmethod
    def _registries_parse(cls, v: list[str]) -> list[str]:
        for entry in v:
            parse_registry_rule(entry)  # ImageRefError is a ValueError: a clear settings error
        return v

    @field_validator("agent_rank_blocked_addresses")
    @classmethod
    def _host_ports(cls, v: list[str]) -> list[str]:
        for address in v:
            host, sep, port = address.rpartition(":")
            if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"an address is host:port, not {address!r}")
        return v

    def to_env(self) -> dict[str, str]:
        """This process's environment with every setting as a ``GPUFLEET_`` variable (for
        child processes, which read their settings from the environment)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
        for name, value in self.model_dump(mode="json").items():
            if value is not None:
                env[f"GPUFLEET_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def node_task_queue(self, node_id: str, recorded: str | None = None) -> str:
        """Where a node's activities run: the shared queue in ``shared`` mode, else the queue
        recorded for the node (``nodes.task_queue``), else prefix + node id."""
        if self.agent_task_queue_mode == "shared":
            return self.agent_shared_task_queue
        return recorded or f"{self.agent_task_queue_prefix}{node_id}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def setting_origins(**init: object) -> dict[str, tuple[str, str]]:
    """Where each setting of ``Settings(**init)`` comes from, in the order
    ``settings_customise_sources`` reads them, as (source, detail): ("init", ""), ("env",
    the variable(s): ``GPUFLEET_X``, or ``GPUFLEET_X__KEY`` for nested values), ("file",
    the path in ``GPUFLEET_X_FILE``: a secret's file) or ("default", ""). Reads names only:
    no file is opened, no value validated."""
    from pydantic_settings import EnvSettingsSource

    from_env = set(EnvSettingsSource(Settings)())
    environ = {k.upper(): k for k in os.environ}
    out: dict[str, tuple[str, str]] = {}
    for name in Settings.model_fields:
        var = f"GPUFLEET_{name.upper()}"
        if name in init:
            out[name] = ("init", "")
        elif name in from_env:
            nested = sorted(v for k, v in environ.items() if k.startswith(var + "__"))
            out[name] = ("env", ", ".join(filter(None, [environ.get(var), *nested])) or var)
        elif name in SECRET_FIELDS and os.environ.get(f"{var}_FILE"):
            out[name] = ("file", os.environ[f"{var}_FILE"])
        else:
            out[name] = ("default", "")
    return out
