"""docker-compose.yml is checked for structure: no Docker engine runs here."""

from __future__ import annotations

from pathlib import Path

import yaml

from common.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_service_is_present():
    services = compose()["services"]
    for name in ("postgres", "temporal", "temporal-ui", "api", "control", "agent"):
        assert name in services, name


def test_services_wait_for_healthy_dependencies():
    services = compose()["services"]
    for name in ("temporal", "api", "control", "agent"):
        deps = services[name]["depends_on"]
        assert isinstance(deps, dict), f"{name}: depends_on must carry conditions"
        for dep, cond in deps.items():
            assert cond["condition"] in ("service_healthy", "service_completed_successfully"), (name, dep)
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}, which has no healthcheck"


def test_temporal_is_backed_by_the_same_postgres():
    t = compose()["services"]["temporal"]
    assert t["environment"]["POSTGRES_SEEDS"] == "postgres"
    assert t["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_every_gpufleet_variable_is_a_real_setting():
    fields = {f.upper() for f in Settings.model_fields}
    seen = 0
    for name, svc in compose()["services"].items():
        for var in svc.get("environment") or {}:
            if var.startswith("GPUFLEET_"):
                seen += 1
                assert var.removeprefix("GPUFLEET_") in fields, f"{name}: {var} is not a setting"
    assert seen >= 10


def test_every_gpufleet_command_exists():
    from typer.testing import CliRunner

    from cli.main import app

    runner = CliRunner()
    for name, svc in compose()["services"].items():
        cmd = svc.get("command")
        if cmd and cmd[0] == "gpufleet":
            result = runner.invoke(app, [*cmd[1:], "--help"])
            assert result.exit_code == 0, f"{name}: `{' '.join(cmd)}` is not a command: {result.output}"
