"""`gpufleet settings` shows the values in effect and where each came from (issue 23: it
printed the defaults): default, an environment variable, a secret's `GPUFLEET_X_FILE`, or an
argument; secrets redacted; `--json` too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.settings import Settings, setting_origins

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.upper().startswith("GPUFLEET_"):
            monkeypatch.delenv(k)
    return monkeypatch


def test_origins_follow_the_sources_order(clean_env, tmp_path):
    secret = tmp_path / "signing"
    secret.write_text("a-signing-key-from-a-file\n")
    secret.chmod(0o600)
    clean_env.setenv("GPUFLEET_API_PORT", "9001")
    clean_env.setenv("gpufleet_leader_ttl_s", "20")  # matched whatever its case, as Settings reads it
    clean_env.setenv("GPUFLEET_MAX_RUNTIME_CAPS_S__research", "3600")
    clean_env.setenv("GPUFLEET_LOG_SIGNING_KEY_FILE", str(secret))
    clean_env.setenv("GPUFLEET_TOKEN", "from-env")
    clean_env.setenv("GPUFLEET_TOKEN_FILE", str(secret))  # the environment wins over the file
    o = setting_origins(api_host="0.0.0.0", api_port=1)
    assert o["api_host"] == ("init", "") and o["api_port"] == ("init", "")  # arguments first
    assert o["leader_ttl_s"] == ("env", "gpufleet_leader_ttl_s")
    assert o["max_runtime_caps_s"] == ("env", "GPUFLEET_MAX_RUNTIME_CAPS_S__research")
    assert o["log_signing_key"] == ("file", str(secret))
    assert o["token"] == ("env", "GPUFLEET_TOKEN")
    assert o["placement_cycle_s"] == ("default", "")
    assert setting_origins()["api_port"] == ("env", "GPUFLEET_API_PORT")
    assert set(o) == set(Settings.model_fields)
    s = Settings(api_host="0.0.0.0", api_port=1)  # and Settings reads them the same way
    assert (s.api_port, s.leader_ttl_s, s.log_signing_key, s.token) == (
        1,
        20.0,
        "a-signing-key-from-a-file",
        "from-env",
    )


def _settings_cmd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("GPUFLEET_")}
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "settings", *args], env={**base, **env, "COLUMNS": "250"}, cwd=ROOT,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_gpufleet_settings_json_shows_values_in_effect_sources_and_redacts_secrets(tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tok-secret-value": {"name": "alice", "team": "a"}}))
    tokens.chmod(0o600)
    env = {
        "GPUFLEET_API_PORT": "9001",
        "GPUFLEET_DATABASE_URL": "postgresql://u:hunter2@db/x",
        "GPUFLEET_API_TOKENS_FILE": str(tokens),
        "GPUFLEET_AGENT_SHARED_SECRET": "",
    }
    r = _settings_cmd(env, "--json")
    assert r.returncode == 0, r.stderr
    assert "hunter2" not in r.stdout and "tok-secret-value" not in r.stdout
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert set(rows) == set(Settings.model_fields)
    assert rows["api_port"]["value"] == 9001
    assert (rows["api_port"]["source"], rows["api_port"]["detail"], rows["api_port"]["default"]) == (
        "env", "GPUFLEET_API_PORT", 8000,
    )  # fmt: skip
    assert rows["database_url"]["value"] == "<redacted>" and rows["database_url"]["secret"] is True
    assert (rows["api_tokens"]["value"], rows["api_tokens"]["source"]) == ("<redacted: 1 entry>", "file")
    assert rows["api_tokens"]["detail"] == str(tokens)
    assert rows["agent_shared_secret"]["value"] == ""  # an empty secret shows as empty: nothing to hide
    assert rows["agent_shared_secret"]["default"] == "<redacted>"  # the dev default is a secret too
    assert (rows["placement_cycle_s"]["value"], rows["placement_cycle_s"]["source"]) == (1.0, "default")

    changed = {row["name"] for row in json.loads(_settings_cmd(env, "--json", "--changed").stdout)}
    assert changed == {"api_port", "database_url", "api_tokens", "agent_shared_secret"}


def test_gpufleet_settings_table_names_the_source():
    r = _settings_cmd({"GPUFLEET_API_PORT": "9001", "GPUFLEET_TOKEN": "tok-hidden"}, "--changed")
    assert r.returncode == 0, r.stderr
    lines = {line.split("│")[1].strip(): line for line in r.stdout.splitlines() if line.count("│") > 2}
    assert "9001" in lines["GPUFLEET_API_PORT"] and " env " in lines["GPUFLEET_API_PORT"]
    assert "<redacted>" in lines["GPUFLEET_TOKEN"] and "tok-hidden" not in r.stdout
    assert set(lines) == {"GPUFLEET_API_PORT", "GPUFLEET_TOKEN"}  # only what is not at its default


def test_a_bad_value_is_one_line_not_a_traceback():
    r = _settings_cmd({"GPUFLEET_API_PORT": "not-a-port"})
    assert r.returncode == 2 and "GPUFLEET_API_PORT" in r.stderr and "Traceback" not in r.stderr
