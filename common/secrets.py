"""Least privilege for secrets: which process holds which, and what a production start refuses.

* ``ROLE_SECRETS``: the secrets each process uses. ``gpufleet up`` and the control process's
  job-worker children hand a child only its own (``role_env``, ``for_role``); the agent gets
  the credentials of the nodes it hosts and nothing of the API's or the database's.
* ``require_production_ready(settings, role)``: with ``GPUFLEET_ENV`` unset (production), a
  standalone ``api``, ``control`` or ``agent`` refuses to start while a secret it uses is
  empty or a built-in dev default, naming the setting. ``GPUFLEET_ENV=dev`` (``gpufleet up``,
  the tests) allows the dev defaults.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Literal

from common.settings import SECRET_FIELDS, Settings

Role = Literal["api", "control", "job-worker", "agent"]

ROLE_SECRETS: dict[str, frozenset[str]] = {
    "api": frozenset({"database_url", "api_tokens", "log_signing_key"}),
    "control": frozenset({"database_url", "agent_shared_secret"}),
    "job-worker": frozenset({"database_url"}),
    "agent": frozenset({"agent_credentials", "agent_log_keys"}),
}
DEV_DEFAULTS = {
    "agent_shared_secret": Settings.model_fields["agent_shared_secret"].default,
    "log_signing_key": Settings.model_fields["log_signing_key"].default,
}
MIN_KEY_CHARS = 16


def _var(name: str) -> str:
    return f"GPUFLEET_{name.upper()}"


def for_role(settings: Settings, role: Role) -> Settings:
    """``settings`` without the secrets ``role`` does not use."""
    keep = ROLE_SECRETS[role]
    cleared = {name: Settings.model_fields[name].get_default(call_default_factory=True) for name in SECRET_FIELDS}
    cleared["agent_shared_secret"] = ""
    cleared["log_signing_key"] = ""
    return settings.model_copy(update={k: v for k, v in cleared.items() if k not in keep})


def role_env(settings: Settings, role: Role, **secrets: object) -> dict[str, str]:
    """A child process's environment: this one's without any ``GPUFLEET_`` variable, every
    setting that is not a secret, and the secrets ``role`` uses (``secrets`` override them:
    e.g. an agent's ``agent_credentials`` for its own nodes only)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    values = for_role(settings, role).model_dump(mode="json")
    values.update(secrets)
    for name, value in values.items():
        if value is None or (name in SECRET_FIELDS and name not in ROLE_SECRETS[role] and name not in secrets):
            continue
        env[_var(name)] = value if isinstance(value, str) else json.dumps(value)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def production_problems(settings: Settings, role: Role, node_ids: Iterable[str] = ()) -> list[str]:
    """What a production start of ``role`` refuses (empty in dev)."""
    if settings.env == "dev":
        return []
    problems: list[str] = []
    if settings.test_faults:
        problems.append(f"{_var('test_faults')} breaks the platform on purpose (for tests only)")
    if role in ("api", "control", "job-worker") and not settings.database_url:
        problems.append(f"{_var('database_url')} is unset")
    if role == "api":
        if not settings.api_tokens:
            problems.append(f"{_var('api_tokens')} is empty: nobody could use the API")
        dev = sorted(p.name for t, p in settings.api_tokens.items() if t.startswith("dev-"))
        if dev:
            problems.append(f"{_var('api_tokens')} holds dev tokens ({', '.join(dev)})")
    if role == "api":
        key = settings.log_signing_key
        if key == DEV_DEFAULTS["log_signing_key"]:
            problems.append(f"{_var('log_signing_key')} is the built-in dev default")
        elif len(key) < MIN_KEY_CHARS:
            problems.append(f"{_var('log_signing_key')} is empty or shorter than {MIN_KEY_CHARS} characters")
    if role in ("control", "agent") and settings.agent_shared_secret:
        what = (
            "the built-in dev default" if settings.agent_shared_secret == DEV_DEFAULTS["agent_shared_secret"] else "set"
        )
        problems.append(
            f"{_var('agent_shared_secret')} is {what}: it derives every node's credential; production issues"
            " per-node credentials (`gpufleet node-credential issue NODE`), so set it empty"
        )
    if role == "agent":
        for name, have in (
            ("agent_credentials", settings.agent_credentials),
            ("agent_log_keys", settings.agent_log_keys),
        ):
            missing = [n for n in node_ids if not have.get(n)]
            if missing:
                problems.append(
                    f"{_var(name)} has nothing for {', '.join(missing[:5])} (`gpufleet node-credential issue NODE`)"
                )
    return problems


def require_production_ready(settings: Settings, role: Role, node_ids: Iterable[str] = ()) -> None:
    from common.embedded import PlatformError

    problems = production_problems(settings, role, node_ids)
    if problems:
        raise PlatformError(
            f"refusing to start {role} as production: "
            + "; ".join(problems)
            + " (GPUFLEET_ENV=dev allows the dev defaults)"
        )
