"""No default secret outside a dev box: a standalone api, control or agent with GPUFLEET_ENV
unset is production and refuses to start while a secret it uses is empty or a dev default,
naming the setting. Secrets may come from files, which must be private to the process's user."""

from __future__ import annotations

import json
import os

import pytest

from common.secrets import ROLE_SECRETS, for_role, production_problems, role_env
from common.settings import Principal, SecretFileError, Settings
from tests.foundation.test_bad_settings import gpufleet

DSN = "postgresql://gpufleet@127.0.0.1:9/gpufleet"  # never reached: the start is refused first


def refused(result, *settings: str) -> str:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "refusing to start" in lines[0] and "production" in lines[0]
    for name in settings:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def test_the_api_refuses_empty_tokens_and_the_dev_log_key():
    r = gpufleet("api", env={"GPUFLEET_DATABASE_URL": DSN})
    refused(r, "GPUFLEET_API_TOKENS", "GPUFLEET_LOG_SIGNING_KEY")


def test_the_api_refuses_dev_tokens():
    tokens = {"dev-alpha-1234": {"name": "dev-alpha", "team": "alpha"}}
    r = gpufleet(
        "api",
        env={
            "GPUFLEET_DATABASE_URL": DSN,
            "GPUFLEET_API_TOKENS": json.dumps(tokens),
            "GPUFLEET_LOG_SIGNING_KEY": "k" * 32,
        },
    )
    line = refused(r, "GPUFLEET_API_TOKENS")
    assert "dev tokens" in line and "GPUFLEET_LOG_SIGNING_KEY" not in line


def test_control_refuses_the_shared_secret_that_derives_every_node_credential():
    r = gpufleet("control", env={"GPUFLEET_DATABASE_URL": DSN})
    assert "node-credential issue" in refused(r, "GPUFLEET_AGENT_SHARED_SECRET")


def test_an_agent_needs_its_own_credential_and_log_key():
    r = gpufleet("agent", "run", "--simulate", "1", "--no-temporal")
    refused(r, "GPUFLEET_AGENT_CREDENTIALS", "GPUFLEET_AGENT_LOG_KEYS", "GPUFLEET_AGENT_SHARED_SECRET")


def test_production_problems_are_none_in_dev_and_none_when_configured():
    dev = Settings(env="dev")
    assert production_problems(dev, "api") == production_problems(dev, "agent", ["n1"]) == []
    prod = Settings(
        env="production",
        database_url=DSN,
        api_tokens={"t" * 40: Principal(name="ops", admin=True)},
        log_signing_key="s" * 32,
        agent_shared_secret="",
        agent_credentials={"n1": "c" * 40},
        agent_log_keys={"n1": "k" * 64},
    )
    for role in ("api", "control", "job-worker"):
        assert production_problems(prod, role) == [], role
    assert production_problems(prod, "agent", ["n1"]) == []
    assert production_problems(prod, "agent", ["n1", "n2"]) == [
        f"GPUFLEET_{name} has nothing for n2 (`gpufleet node-credential issue NODE`)"
        for name in ("AGENT_CREDENTIALS", "AGENT_LOG_KEYS")
    ]


def test_each_child_gets_only_its_own_secrets():
    s = Settings(
        env="dev",
        database_url=DSN,
        api_tokens={"tok-123": Principal(name="alice", team="a")},
        agent_shared_secret="derives-everything",
        log_signing_key="log-key-log-key-log-key",
    )
    api, control, agent = (
        role_env(s, "api"),
        role_env(s, "control"),
        role_env(s, "agent", agent_credentials={"n1": "c1"}, agent_log_keys={"n1": "k1"}),
    )
    assert "tok-123" in api["GPUFLEET_API_TOKENS"] and api["GPUFLEET_DATABASE_URL"] == DSN
    assert "GPUFLEET_AGENT_SHARED_SECRET" not in api or api["GPUFLEET_AGENT_SHARED_SECRET"] == ""
    assert control["GPUFLEET_AGENT_SHARED_SECRET"] == "derives-everything"
    assert "tok-123" not in json.dumps(control) and "log-key" not in json.dumps(control)
    blob = json.dumps(agent)
    assert "tok-123" not in blob and DSN not in blob and "derives-everything" not in blob
    assert json.loads(agent["GPUFLEET_AGENT_CREDENTIALS"]) == {"n1": "c1"}
    assert "log-key-log-key" not in blob, "an agent holds its nodes' log keys, not the key that derives them"
    assert json.loads(agent["GPUFLEET_AGENT_LOG_KEYS"]) == {"n1": "k1"} and agent["GPUFLEET_ENV"] == "dev"
    # every non-secret setting travels
    assert agent["GPUFLEET_CONTROL_TASK_QUEUE"] == s.control_task_queue
    worker = for_role(s, "job-worker")
    assert worker.database_url == DSN and not worker.api_tokens and not worker.agent_shared_secret
    assert set(ROLE_SECRETS) == {"api", "control", "job-worker", "agent"}


def test_a_secret_comes_from_a_private_file(tmp_path, monkeypatch):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"file-token": {"name": "ops", "admin": True}}))
    path.chmod(0o600)
    monkeypatch.setenv("GPUFLEET_API_TOKENS_FILE", str(path))
    key = tmp_path / "log.key"
    key.write_text("from-a-file-from-a-file\n")
    key.chmod(0o400)
    monkeypatch.setenv("GPUFLEET_LOG_SIGNING_KEY_FILE", str(key))
    s = Settings()
    assert s.api_tokens["file-token"].admin and s.log_signing_key == "from-a-file-from-a-file"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_secret_file_others_can_read_is_refused(tmp_path, monkeypatch, mode):
    path = tmp_path / "key"
    path.write_text("secret")
    path.chmod(mode)
    monkeypatch.setenv("GPUFLEET_LOG_SIGNING_KEY_FILE", str(path))
    with pytest.raises(SecretFileError, match="lets others read it"):
        Settings()


def test_a_secret_file_of_another_user_is_refused(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    path = tmp_path / "key"
    path.write_text("secret")
    path.chmod(0o600)
    os.chown(path, 65534, 65534)
    monkeypatch.setenv("GPUFLEET_LOG_SIGNING_KEY_FILE", str(path))
    with pytest.raises(SecretFileError, match="owned by uid 65534"):
        Settings()
