"""The job spec as stored (``jobs.spec``, JSON): the fields the control plane reads from it."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from typing import Any


def parse_spec(spec: Any) -> dict[str, Any]:
    if spec is None:
        return {}
    if isinstance(spec, str):
        return json.loads(spec)
    return dict(spec)


def spec_command(spec: Mapping[str, Any]) -> list[str]:
    cmd = spec.get("command") or []
    if isinstance(cmd, str):
        return shlex.split(cmd)
    return [str(c) for c in cmd]


def spec_env(spec: Mapping[str, Any]) -> dict[str, str]:
    env = spec.get("env") or {}
    return {str(k): str(v) for k, v in dict(env).items()}


def spec_checkpoint(spec: Mapping[str, Any]) -> dict[str, Any]:
    ck = spec.get("checkpoint") or {}
    return dict(ck) if isinstance(ck, Mapping) else {}


def spec_grace_s(spec: Mapping[str, Any], default: float) -> float:
    ck = spec_checkpoint(spec)
    for v in (spec.get("grace_seconds"), spec.get("grace_s"), ck.get("grace_seconds"), ck.get("grace_s")):
        if v is not None:
            return float(v)
    return default
