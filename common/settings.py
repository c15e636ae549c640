"""All of gpufleet's settings in one place (environment prefix ``GPUFLEET_``).

Every duration is a setting so tests can run leases, heartbeats and grace
periods in seconds. Pydantic lives here and at the HTTP edge only.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Principal(BaseModel):
    """Who a bearer token stands for: a member of one team, or an admin."""

    name: str
    team: str | None = None
    admin: bool = False


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUFLEET_", env_nested_delimiter="__", extra="ignore")

    # --- where things live -------------------------------------------------
    state_dir: Path = Field(Path(".gpufleet"), description="state of the embedded services and agents")
    database_url: str | None = Field(None, description="external Postgres; unset = embedded pgserver")
    temporal_address: str | None = Field(None, description="external Temporal frontend; unset = embedded dev server")
    temporal_namespace: str = "default"
    temporal_port: int = Field(7233, description="embedded Temporal dev server frontend port")
    temporal_ui_port: int = Field(8233, description="embedded Temporal Web UI port")
    db_pool_min: int = 1
    db_pool_max: int = 10

    # --- processes ---------------------------------------------------------
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    control_task_queue: str = "gpufleet-control"
    control_grpc_host: str = "127.0.0.1"
    control_grpc_port: int = 50051
    control_addresses: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:50051"], description="every control gRPC address, for agents"
    )
    agent_task_queue_prefix: str = "gpufleet-node-"
    agent_simulate: int = Field(16, description="simulated nodes hosted by `make up`'s agent process")
    agent_nvml_backend: Literal["real", "simulated"] = "simulated"
    agent_credentials: dict[str, str] = Field(default_factory=dict, description="node_id -> credential")
    agent_shared_secret: str = Field("dev-agent-secret", description="derives per-node credentials in dev")

    # --- leadership (DESIGN.md, Leadership) --------------------------------
    leader_scope: str = "placement"
    leader_renew_s: float = 5.0
    leader_ttl_s: float = 15.0
    takeover_quiet_s: float = Field(30.0, description="no node marked suspect this long after takeover")

    # --- placement ----------------------------------------------------------
    placement_cycle_s: float = 1.0
    placement_lookahead: int = 2000
    hot_spare_fraction: float = 0.015
    preemption_protect_s: float = 1800.0
    preemption_daily_budget: int = 3
    fair_share_half_life_h: float = 84.0  # a 7-day window, decaying

    # --- jobs (DESIGN.md, Job lifecycle) ------------------------------------
    gang_start_timeout_s: float = 600.0
    default_grace_s: float = 30.0
    max_runtime_caps_s: dict[str, float] = Field(
        default_factory=lambda: {
            "prod-serving": 90 * 24 * 3600.0,
            "prod-batch": 14 * 24 * 3600.0,
            "research": 7 * 24 * 3600.0,
            "preemptible": 3 * 24 * 3600.0,
        }
    )
    max_extensions: int = 2
    max_extension_fraction: float = 0.25
    max_failed_attempts: int = 3

    # --- health (DESIGN.md, Health) -----------------------------------------
    heartbeat_interval_s: float = 5.0
    suspect_after_s: float = 30.0
    down_after_s: float = 90.0
    unconfirmed_kill_s: float = 900.0
    fence_margin: float = 1.5
    hang_after_s: float = 600.0
    missing_task_release_s: float = 120.0

    # --- API ----------------------------------------------------------------
    api_tokens: dict[str, Principal] = Field(default_factory=dict, description="bearer token -> principal")
    allowed_registries: list[str] = Field(default_factory=lambda: ["registry/"])
    max_queued_per_team: int = 5000
    max_page_size: int = 500
    max_request_bytes: int = 1_000_000
    idempotency_ttl_s: float = 24 * 3600.0

    # --- demo cluster seeded by `make up` -----------------------------------
    demo_blocks: int = 4
    demo_nodes_per_block: int = 4
    demo_gpus_per_node: int = 8
    demo_gpu_type: str = "h100"

    @field_validator("state_dir")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    def node_task_queue(self, node_id: str) -> str:
        return f"{self.agent_task_queue_prefix}{node_id}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
