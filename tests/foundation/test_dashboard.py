"""The Grafana dashboard, its provisioning and Prometheus's scrape config, checked against
what the three gpufleet processes actually expose: no Grafana or Prometheus runs here."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from common.embedded import parse_listen

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/dashboards/gpufleet.json"
PROMETHEUS = ROOT / "deploy/prometheus/prometheus.yml"
DATASOURCES = ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml"
PROVIDERS = ROOT / "deploy/grafana/provisioning/dashboards/gpufleet.yml"
UID = "prometheus"

# exported families no panel shows, and why
LEFT_OUT = {
    "gpufleet_gpu_info": "maps (node, gpu) to the GPU's UUID: for joins when a board is swapped, not a chart",
    "gpufleet_cluster_allocated_gpus": "the API's Postgres copy of gpufleet_gpus_allocated (charted from the leader)",
    "gpufleet_cluster_queued_jobs": "the API's Postgres copy of gpufleet_queued_jobs (charted by class and size)",
    "gpufleet_cluster_idle_gpus": "the API's Postgres copy of gpufleet_gpus_idle",
    "gpufleet_cluster_idle_gpu_cost_usd_per_hour": "the API's Postgres copy of gpufleet_idle_gpu_cost_usd_per_hour",
    "gpufleet_cluster_allocated_idle_gpus": "the API's Postgres copy of gpufleet_allocated_idle_gpus",
}

_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$", re.M)
_NAME = re.compile(r"gpufleet_[a-z0-9_]+")
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def _types(text: bytes) -> dict[str, str]:
    """family name as exposed (counters with their ``_total``) -> type, from exposition text."""
    return {
        name: kind
        for name, kind in _TYPE.findall(text.decode())
        if name.startswith("gpufleet_") and not name.endswith("_created")
    }


def control_families() -> dict[str, str]:
    import control.health.metrics  # noqa: F401  (registers the health families on the default registry)
    from control.leader.metrics import ControlMetrics

    leading = ControlMetrics("dashboard-test", 2.0)
    leading.epoch = 1  # the cluster gauges appear only while the process leads
    return {**_types(generate_latest(leading.registry)), **_types(generate_latest(REGISTRY))}


def api_families() -> dict[str, str]:
    from api.metrics import METRIC_NAMES, ApiMetrics
    from store.cluster_view import ClusterView

    m = ApiMetrics()
    m.cluster.view = ClusterView(nodes=(), queue=(), teams=(), allocated_idle={}, gpu_hour_usd=2.0)
    found = _types(generate_latest(m.registry))
    assert set(found) == set(METRIC_NAMES), "api.metrics.METRIC_NAMES and the API's /metrics disagree"
    return found


def agent_families() -> dict[str, str]:
    from worker_agent.metrics import METRIC_NAMES, AgentCollector

    r = CollectorRegistry(auto_describe=False)
    r.register(AgentCollector(lambda: []))
    found = _types(generate_latest(r))
    assert set(found) == set(METRIC_NAMES), "worker_agent.metrics.METRIC_NAMES and the agent's /metrics disagree"
    return found


@pytest.fixture(scope="module")
def families() -> dict[str, str]:
    out: dict[str, str] = {}
    for part in (control_families(), api_families(), agent_families()):
        assert part, "a process exposes no gpufleet family"
        out.update(part)
    return out


def series_names(families: dict[str, str]) -> dict[str, str]:
    """Every sample name a query may use -> its family."""
    out: dict[str, str] = {}
    for family, kind in families.items():
        out[family] = family
        for suffix in _SUFFIXES.get(kind, ()):
            out[family + suffix] = family
    return out


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(d: dict) -> Iterator[dict]:
    for p in d["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row holds its panels


def expressions(d: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for p in all_panels(d):
        for t in p.get("targets", []):
            yield f"panel {p['id']} {p['title']!r} {t.get('refId')}", t["expr"]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            yield f"variable {v['name']}", q["query"] if isinstance(q, dict) else q


def used_families(expr: str, series: dict[str, str]) -> tuple[set[str], set[str]]:
    """(families the expression names, names in it no process exposes)."""
    names = set(_NAME.findall(expr))
    return {series[n] for n in names if n in series}, {n for n in names if n not in series}


# ------------------------------------------------------------------ (a) metric names


def test_every_query_names_only_exported_metrics(families):
    series = series_names(families)
    unknown = {}
    for where, expr in expressions(dashboard()):
        assert _NAME.search(expr), f"{where}: names no gpufleet metric: {expr}"
        _, bad = used_families(expr, series)
        if bad:
            unknown[where] = sorted(bad)
    assert not unknown, f"queries name metrics no gpufleet process exposes: {unknown}"


def test_a_wrong_name_is_caught(families):
    series = series_names(families)
    for expr in (
        "sum(gpufleet_gpus_allocatd)",
        "sum(rate(gpufleet_preemptions[5m]))",  # a counter is exposed with its _total
        "histogram_quantile(0.9, rate(gpufleet_gpus_idle_bucket[5m]))",  # a gauge has no buckets
    ):
        assert used_families(expr, series)[1], expr
    ok = "histogram_quantile(0.95, sum by (le) (rate(gpufleet_queue_wait_seconds_bucket[5m])))"
    assert used_families(ok, series) == ({"gpufleet_queue_wait_seconds"}, set())


def test_every_exported_family_is_charted(families):
    series = series_names(families)
    used: set[str] = set()
    for _, expr in expressions(dashboard()):
        used |= used_families(expr, series)[0]
    assert not set(LEFT_OUT) - set(families), "LEFT_OUT names a family no process exposes"
    assert not set(LEFT_OUT) & used, "a family in LEFT_OUT is charted after all: drop it from LEFT_OUT"
    missing = sorted(set(families) - used - set(LEFT_OUT))
    assert not missing, f"exported families no panel shows (chart them or say why in LEFT_OUT): {missing}"


def test_histograms_are_read_as_quantiles_of_rates(families):
    for where, expr in expressions(dashboard()):
        if "_bucket" in expr:
            assert "histogram_quantile(" in expr and "rate(" in expr, where
            assert re.search(r"by \(le\b|by \([^)]*\ble\b", expr), f"{where}: buckets must keep le: {expr}"


# ------------------------------------------------------------------ (b) Grafana shape


def test_dashboard_is_grafana_shaped():
    d = dashboard()
    assert d["uid"] and d["title"]
    assert 36 <= d["schemaVersion"] <= 41
    ids = [p["id"] for p in all_panels(d)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in all_panels(d):
        where = f"panel {p['id']} {p.get('title')!r}"
        pos = p["gridPos"]
        assert {"h", "w", "x", "y"} <= set(pos), where
        assert pos["h"] > 0 and 0 < pos["w"] and pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, where
        assert p["title"], where
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": UID}, where
        targets = p["targets"]
        assert targets, f"{where}: no targets"
        refs = [t["refId"] for t in targets]
        assert all(refs) and len(refs) == len(set(refs)), f"{where}: refIds must be set and unique"
        for t in targets:
            assert t["datasource"]["uid"] == UID, where
            assert t["expr"].strip(), where


def test_panels_do_not_overlap():
    cells: dict[tuple[int, int], int] = {}
    for p in dashboard()["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]} and {p['id']} overlap"
                cells[(x, y)] = p["id"]


def test_rows_cover_what_operators_ask():
    rows = [p["title"].lower() for p in dashboard()["panels"] if p["type"] == "row"]
    for topic in ("allocation", "real use", "team", "queue", "preemption", "failure", "cost", "api"):
        assert any(topic in r for r in rows), f"no row about {topic}: {rows}"


def test_variables_filter_by_gpu_type_and_team():
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    for name in ("gpu_type", "team"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == UID
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        assert re.fullmatch(rf"label_values\(gpufleet_[a-z0-9_]+, {name}\)", q), q
        assert v["includeAll"] and v["allValue"] == ".*", f"{name}: 'All' must match every value"
        exprs = [e for _, e in expressions(d)]
        assert any(f'{name}=~"${name}"' in e for e in exprs), f"no panel filters by ${name}"
    # a variable used in a query is defined
    for where, expr in expressions(d):
        for ref in re.findall(r"\$(?!__)([a-z_]+)", expr):
            assert ref in variables, f"{where}: ${ref} is not a variable"


# ------------------------------------------------------------------ provisioning and compose


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _mounts(svc: dict) -> dict[str, Path]:
    """container path -> repo path, for every bind mount of a repo file or folder."""
    out = {}
    for m in svc.get("volumes", []):
        src, dst, *_ = m.split(":")
        if src.startswith("./"):
            out[dst] = ROOT / src
    return out


def test_datasource_is_the_compose_prometheus():
    (ds,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert ds["uid"] == UID and ds["type"] == "prometheus"
    assert ds["url"] == "http://prometheus:9090"
    assert "prometheus" in compose()["services"]


def test_dashboards_provider_reads_the_mounted_folder():
    (provider,) = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    mounts = _mounts(compose()["services"]["grafana"])
    assert path in mounts, f"grafana mounts nothing at {path}"
    assert mounts[path] == DASHBOARD.parent and any(mounts[path].glob("*.json"))


def test_prometheus_and_grafana_mount_files_that_exist():
    services = compose()["services"]
    prom, graf = services["prometheus"], services["grafana"]
    assert prom["image"].startswith("prom/prometheus") and graf["image"].startswith("grafana/grafana")
    assert "9090:9090" in prom["ports"] and "3000:3000" in graf["ports"]
    pm = _mounts(prom)
    assert pm["/etc/prometheus/prometheus.yml"] == PROMETHEUS
    gm = _mounts(graf)
    assert gm["/etc/grafana/provisioning"] == DATASOURCES.parent.parent
    for svc in (prom, graf):
        for m in svc["volumes"]:
            if m.startswith("./"):
                assert m.endswith(":ro"), f"{m}: config is mounted read-only"
    for path in (*pm.values(), *gm.values()):
        assert path.exists(), f"mounted {path} is not in the repo"
    env = graf["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert graf["depends_on"]["prometheus"]["condition"] == "service_healthy" and "healthcheck" in prom


def _metrics_port(name: str, svc: dict) -> int:
    """The port the compose service serves /metrics on, from its GPUFLEET_ settings."""
    env = svc["environment"]
    if name == "api":
        assert env["GPUFLEET_API_HOST"] == "0.0.0.0"
        return int(env["GPUFLEET_API_PORT"])
    key = {"control": "GPUFLEET_CONTROL_METRICS_LISTEN", "agent": "GPUFLEET_AGENT_HTTP_LISTEN"}[name]
    host, port = parse_listen(env[key])
    assert host == "0.0.0.0", f"{name}: {key} must listen beyond the container for prometheus"
    return port


def test_prometheus_scrapes_every_gpufleet_process():
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert config["global"]["scrape_interval"] == "15s"
    targets = set()
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics", job["job_name"]
        for sc in job["static_configs"]:
            targets |= set(sc["targets"])
    services = compose()["services"]
    expected = {f"{name}:{_metrics_port(name, services[name])}" for name in ("api", "control", "agent")}
    assert targets == expected
    for t in targets:
        assert t.split(":")[0] in services, t
