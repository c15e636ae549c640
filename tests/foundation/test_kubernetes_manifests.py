"""deploy/kubernetes/ checked offline (no cluster runs here; docs/kubernetes.md).

Every manifest validates against the Kubernetes OpenAPI schemas of ``K8S_VERSION``
(``kubernetes-validate``, strict: an unknown field is an error), and the manifests agree
with each other and with gpufleet: every ``GPUFLEET_`` variable is a real setting and the
values parse, container ports are the ports the settings make each process listen on,
Services, PodDisruptionBudgets and NetworkPolicies select pods that exist and name ports
those pods have, every Secret, ConfigMap, ServiceAccount and PriorityClass referenced is
defined, and no manifest holds a real-looking secret. The last tests break a copy of the
manifests on purpose and expect each check to say so.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import kubernetes_validate
import pytest
import yaml

from common.settings import SECRET_FIELDS, Settings

ROOT = Path(__file__).resolve().parents[2]
KDIR = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet", "Job")
CLUSTER_SCOPED = ("Namespace", "PriorityClass", "ClusterRole", "ClusterRoleBinding")
FIELDS = {name.upper() for name in Settings.model_fields}
FILE_VARS = {f"{name.upper()}_FILE" for name in SECRET_FIELDS}
# what the downward API gives a container, for the checks that need a value
FIELD_REF_SAMPLES = {"spec.nodeName": "gpu-b0-n0", "status.podIP": "10.1.2.3", "status.hostIP": "10.1.2.3"}
PLACEHOLDER = "REPLACE_ME"
REAL_LOOKING = [
    (re.compile(r"postgres(?:ql)?://[^:/@\s]+:[^@\s]+@"), "a database URL with a password"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "a private key"),
    (re.compile(r"\bdev-[A-Za-z0-9_-]{6,}"), "a dev token"),
    (re.compile(r"(?<![A-Za-z0-9+/_-])[A-Fa-f0-9]{32,}(?![A-Za-z0-9+/_-])"), "a long hex string"),
    (re.compile(r"(?<![A-Za-z0-9+/_.-])(?=[A-Za-z0-9+/_-]*[0-9])[A-Za-z0-9+/_-]{40,}={0,2}"), "a long token"),
]

Doc = dict[str, Any]


def load() -> list[tuple[str, Doc]]:
    """Every manifest under deploy/kubernetes (secrets-example/ included), as (file, doc)."""
    out = []
    for path in sorted(KDIR.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((str(path.relative_to(KDIR)), doc))
    return out


def _name(doc: Doc) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def _ns(doc: Doc) -> str | None:
    return doc.get("metadata", {}).get("namespace")


def _of(docs: list[tuple[str, Doc]], kind: str) -> Iterator[tuple[str, Doc]]:
    return ((f, d) for f, d in docs if d.get("kind") == kind)


def _pod(doc: Doc) -> Doc:
    return doc["spec"]["template"]


def _containers(doc: Doc) -> list[Doc]:
    spec = _pod(doc)["spec"]
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _selects(selector: Doc, labels: Doc) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _listen_port(listen: str) -> int:
    return int(listen.rpartition(":")[2])


def _listen_host(listen: str) -> str:
    return listen.rpartition(":")[0].strip("[]")


# --- schemas ------------------------------------------------------------------------------


@functools.cache
def _schema_problem(text: str) -> str | None:
    """One manifest (as JSON) against the schemas; cached: the breakage tests revalidate copies."""
    doc = json.loads(text)
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{'.'.join(str(p) for p in e.path)}: {e.message}"
    except kubernetes_validate.SchemaNotFoundError as e:
        return e.message
    return None


def schema_problems(docs: list[tuple[str, Doc]]) -> list[str]:
    problems = []
    for f, doc in docs:
        problem = _schema_problem(json.dumps(doc, sort_keys=True))
        if problem:
            problems.append(f"{f}: {_name(doc)}: {problem}")
    return problems


# --- settings -------------------------------------------------------------------------------


def container_env(docs: list[tuple[str, Doc]], ns: str | None, container: Doc) -> dict[str, str | None]:
    """The environment a container starts with: its ConfigMaps' data, then its own ``env``
    (``$(VAR)`` expanded as the kubelet does); a value from a Secret is None."""
    maps = {d["metadata"]["name"]: d.get("data", {}) for _, d in _of(docs, "ConfigMap") if _ns(d) == ns}
    env: dict[str, str | None] = {}
    for src in container.get("envFrom", []):
        if "configMapRef" in src:
            env.update(maps.get(src["configMapRef"]["name"], {}))
    for var in container.get("env", []):
        if "value" in var:
            value = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1)) or m.group(0), str(var["value"])
            )
            env[var["name"]] = value
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = FIELD_REF_SAMPLES.get(var["valueFrom"]["fieldRef"]["fieldPath"], "x")
        else:
            env[var["name"]] = None
    return env


def settings_from(env: dict[str, str | None]) -> Settings:
    """The settings a process with ``env`` gets (secrets and secret files left out)."""
    given = {k: v for k, v in env.items() if k.startswith("GPUFLEET_") and v is not None and not k.endswith("_FILE")}
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    with mock.patch.dict(os.environ, {**clean, **given}, clear=True):
        return Settings()


def gpufleet_containers(docs: list[tuple[str, Doc]]) -> Iterator[tuple[str, Doc, Doc, str]]:
    """(file, workload, container, role) for every container that runs a gpufleet process."""
    for kind in WORKLOADS:
        for f, doc in _of(docs, kind):
            for c in _containers(doc):
                cmd = c.get("command") or c.get("args") or []
                if cmd[:1] == ["gpufleet"] and len(cmd) > 1:
                    yield f, doc, c, cmd[1]


def setting_problems(docs: list[tuple[str, Doc]]) -> list[str]:
    problems = []
    names: list[tuple[str, str]] = []
    for f, doc in _of(docs, "ConfigMap"):
        names += [(f"{f}: {_name(doc)}", k) for k in doc.get("data", {})]
    for kind in WORKLOADS:
        for f, doc in _of(docs, kind):
            for c in _containers(doc):
                names += [(f"{f}: {_name(doc)}/{c['name']}", v["name"]) for v in c.get("env", [])]
    for where, var in names:
        if var.startswith("GPUFLEET_"):
            name = var.removeprefix("GPUFLEET_")
            if name not in FIELDS and name not in FILE_VARS:
                problems.append(f"{where}: {var} is not a setting of common.settings.Settings")
    for f, doc, c, _role in gpufleet_containers(docs):
        try:
            settings_from(container_env(docs, _ns(doc), c))
        except Exception as e:  # pydantic's ValidationError, or a registry rule that does not parse
            problems.append(f"{f}: {_name(doc)}/{c['name']}: its settings do not parse: {e}")
    return problems


# --- ports ------------------------------------------------------------------------------------


def port_problems(docs: list[tuple[str, Doc]]) -> list[str]:
    """Each gpufleet container declares exactly the ports its settings make it listen on, on
    addresses others can reach (and, where advertised, that others can dial)."""
    problems = []
    services = {(_ns(d), d["metadata"]["name"]): d for _, d in _of(docs, "Service")}
    for f, doc, c, role in gpufleet_containers(docs):
        where = f"{f}: {_name(doc)}/{c['name']}"
        env = container_env(docs, _ns(doc), c)
        try:
            s = settings_from(env)
        except Exception:
            continue  # setting_problems says why
        declared = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        expected: dict[str, int] = {}
        hosts: list[tuple[str, str, bool]] = []  # (setting, host, advertised)
        if role == "api":
            expected = {"http": s.api_port}
            hosts = [("api_host", s.api_host, False)]
        elif role == "control":
            expected = {"grpc": s.control_grpc_port, "metrics": _listen_port(s.control_metrics_listen)}
            hosts = [
                ("control_grpc_host", s.control_grpc_host, True),  # written to the leader row
                ("control_metrics_listen", _listen_host(s.control_metrics_listen), False),
            ]
        elif role == "agent":
            expected = {"http": _listen_port(s.agent_http_listen)}
            hosts = [("agent_http_listen", _listen_host(s.agent_http_listen), True)]  # heartbeats' agent_addr
            for addr in s.control_addresses:
                host, _, port = addr.rpartition(":")
                m = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc(?:\.cluster\.local)?", host)
                svc = services.get((m.group(2), m.group(1))) if m else None
                if svc is None or int(port) not in [p["port"] for p in svc["spec"]["ports"]]:
                    problems.append(f"{where}: control address {addr} is no port of a Service in these manifests")
        else:
            continue  # one-shot commands (db migrate) listen on nothing
        if declared != expected:
            problems.append(f"{where}: container ports {declared} but its settings listen on {expected}")
        for setting, host, advertised in hosts:
            if host in ("127.0.0.1", "localhost", "::1"):
                problems.append(f"{where}: {setting} listens on {host}: nothing outside the pod reaches it")
            if advertised and host in ("", "0.0.0.0", "::"):
                problems.append(f"{where}: {setting} is a wildcard ({host!r}) but is advertised to others")
        scrape = _pod(doc)["metadata"].get("annotations", {}).get("prometheus.io/port")
        if scrape is not None and int(scrape) not in expected.values():
            problems.append(f"{where}: prometheus.io/port {scrape} is none of its ports {expected}")
    return problems


# --- references -------------------------------------------------------------------------------


def _pods_in(docs: list[tuple[str, Doc]], ns: str | None) -> list[Doc]:
    return [d for kind in WORKLOADS for _, d in _of(docs, kind) if _ns(d) == ns]


def _port_names(workloads: list[Doc]) -> set[str]:
    return {p["name"] for w in workloads for c in _containers(w) for p in c.get("ports", []) if "name" in p}


def reference_problems(docs: list[tuple[str, Doc]]) -> list[str]:
    problems = []
    defined = {(d["kind"], _ns(d), d["metadata"]["name"]) for _, d in docs}
    secrets = {
        (_ns(d), d["metadata"]["name"]): {**d.get("data", {}), **d.get("stringData", {})}
        for _, d in _of(docs, "Secret")
    }
    namespaces = {d["metadata"]["name"] for _, d in _of(docs, "Namespace")}

    for f, doc in docs:
        if doc["kind"] not in CLUSTER_SCOPED and _ns(doc) not in namespaces:
            problems.append(f"{f}: {_name(doc)}: namespace {_ns(doc)!r} is not one of these manifests'")

    for kind in WORKLOADS:
        for f, doc in _of(docs, kind):
            where = f"{f}: {_name(doc)}"
            ns = _ns(doc)
            pod = _pod(doc)
            labels = pod["metadata"].get("labels", {})
            sel = doc["spec"].get("selector", {}).get("matchLabels")
            if sel is not None and not _selects(sel, labels):
                problems.append(f"{where}: selector {sel} does not match its pod labels {labels}")
            spec = pod["spec"]
            if "serviceAccountName" in spec and ("ServiceAccount", ns, spec["serviceAccountName"]) not in defined:
                problems.append(f"{where}: ServiceAccount {spec['serviceAccountName']} is not defined")
            if "priorityClassName" in spec and ("PriorityClass", None, spec["priorityClassName"]) not in defined:
                problems.append(f"{where}: PriorityClass {spec['priorityClassName']} is not defined")
            for c in _containers(doc):
                cw = f"{where}/{c['name']}"
                for src in c.get("envFrom", []):
                    for key, kind_ in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                        if key in src and (kind_, ns, src[key]["name"]) not in defined:
                            problems.append(f"{cw}: {kind_} {src[key]['name']} is not defined")
                for var in c.get("env", []):
                    for key, kind_ in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
                        ref = var.get("valueFrom", {}).get(key)
                        if ref is None:
                            continue
                        if kind_ == "Secret" and ref["key"] not in secrets.get((ns, ref["name"]), {}):
                            problems.append(
                                f"{cw}: {var['name']} reads Secret {ref['name']} key {ref['key']}: not defined"
                            )
                        if kind_ == "ConfigMap" and (kind_, ns, ref["name"]) not in defined:
                            problems.append(f"{cw}: {var['name']} reads ConfigMap {ref['name']}: not defined")
                names = {p["name"] for p in c.get("ports", []) if "name" in p}
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                    for how in ("httpGet", "tcpSocket", "grpc"):
                        port = c.get(probe, {}).get(how, {}).get("port")
                        if isinstance(port, str) and port not in names:
                            problems.append(f"{cw}: {probe} names port {port}, which it does not have")
            for vol in spec.get("volumes", []):
                if "secret" in vol and ("Secret", ns, vol["secret"]["secretName"]) not in defined:
                    problems.append(
                        f"{where}: volume {vol['name']}: Secret {vol['secret']['secretName']} is not defined"
                    )

    for f, doc in _of(docs, "Service"):
        where = f"{f}: {_name(doc)}"
        sel = doc["spec"].get("selector") or {}
        chosen = [w for w in _pods_in(docs, _ns(doc)) if _selects(sel, _pod(w)["metadata"].get("labels", {}))]
        if not chosen:
            problems.append(f"{where}: selector {sel} matches no pods of these manifests")
            continue
        names = _port_names(chosen)
        numbers = {p["containerPort"] for w in chosen for c in _containers(w) for p in c.get("ports", [])}
        for p in doc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            if (isinstance(target, str) and target not in names) or (isinstance(target, int) and target not in numbers):
                problems.append(f"{where}: port {p.get('name')} targets {target}, which its pods do not have")

    for f, doc in _of(docs, "PodDisruptionBudget"):
        sel = doc["spec"]["selector"]["matchLabels"]
        if not any(_selects(sel, _pod(w)["metadata"].get("labels", {})) for w in _pods_in(docs, _ns(doc))):
            problems.append(f"{f}: {_name(doc)}: selector {sel} matches no pods")

    for f, doc in _of(docs, "NetworkPolicy"):
        where = f"{f}: {_name(doc)}"
        sel = doc["spec"]["podSelector"].get("matchLabels", {})
        targets = [w for w in _pods_in(docs, _ns(doc)) if _selects(sel, _pod(w)["metadata"].get("labels", {}))]
        if not targets:
            problems.append(f"{where}: podSelector {sel} matches no pods")
        names = _port_names(targets)
        for rule in doc["spec"].get("ingress", []):
            for p in rule.get("ports", []):
                if isinstance(p.get("port"), str) and p["port"] not in names:
                    problems.append(f"{where}: port {p['port']} is no port of the pods it guards")
            for peer in rule.get("from", []):
                if "podSelector" not in peer:
                    continue
                peer_ns = (
                    peer.get("namespaceSelector", {})
                    .get("matchLabels", {})
                    .get("kubernetes.io/metadata.name", _ns(doc))
                )
                psel = peer["podSelector"].get("matchLabels", {})
                if not any(_selects(psel, _pod(w)["metadata"].get("labels", {})) for w in _pods_in(docs, peer_ns)):
                    problems.append(f"{where}: peer {psel} in namespace {peer_ns} matches no pods")
    return problems


# --- secrets ----------------------------------------------------------------------------------


def secret_problems(docs: list[tuple[str, Doc]]) -> list[str]:
    problems = []
    for f, doc in _of(docs, "Secret"):
        where = f"{f}: {_name(doc)}"
        if doc.get("data"):
            problems.append(f"{where}: has data (base64 values); placeholders go in stringData")
        for key, value in (doc.get("stringData") or {}).items():
            if not str(value).startswith(PLACEHOLDER):
                problems.append(f"{where}: {key} is not a {PLACEHOLDER} placeholder")
    secret_vars = {f"GPUFLEET_{n.upper()}" for n in SECRET_FIELDS}
    for kind in ("ConfigMap", *WORKLOADS):
        for f, doc in _of(docs, kind):
            literals = list((doc.get("data") or {}).items()) if kind == "ConfigMap" else []
            if kind != "ConfigMap":
                literals = [(v["name"], v["value"]) for c in _containers(doc) for v in c.get("env", []) if "value" in v]
            for var, value in literals:
                if var in secret_vars and value != "":
                    problems.append(f"{f}: {_name(doc)}: {var} is a secret but has a literal value")
    for f, doc in docs:
        text = yaml.safe_dump(doc)
        for pattern, what in REAL_LOOKING:
            m = pattern.search(text)
            if m:
                problems.append(f"{f}: {_name(doc)}: holds {what}: {m.group(0)[:12]}...")
    return problems


# --- the tests ----------------------------------------------------------------------------------


def all_problems(docs: list[tuple[str, Doc]]) -> list[str]:
    return [
        *schema_problems(docs),
        *setting_problems(docs),
        *port_problems(docs),
        *reference_problems(docs),
        *secret_problems(docs),
    ]


@pytest.fixture(scope="module")
def docs() -> list[tuple[str, Doc]]:
    return load()


def test_the_manifests_are_all_there(docs):
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in docs}
    for want in [
        ("Deployment", "gpufleet-api"),
        ("Service", "gpufleet-api"),
        ("PodDisruptionBudget", "gpufleet-api"),
        ("Deployment", "gpufleet-control"),
        ("Service", "gpufleet-control"),
        ("PodDisruptionBudget", "gpufleet-control"),
        ("DaemonSet", "gpufleet-agent"),
        ("ConfigMap", "gpufleet-settings"),
        ("Secret", "gpufleet-database"),
        ("NetworkPolicy", "gpufleet-control-ingress"),
    ]:
        assert want in kinds, want
    roles = {role for *_, role in gpufleet_containers(docs)}
    assert {"api", "control", "agent"} <= roles


def test_every_manifest_validates_against_the_kubernetes_schemas(docs):
    assert not schema_problems(docs)


def test_every_gpufleet_variable_is_a_setting_and_parses(docs):
    assert not setting_problems(docs)


def test_container_ports_are_the_ports_the_settings_listen_on(docs):
    assert not port_problems(docs)


def test_every_reference_resolves(docs):
    assert not reference_problems(docs)


def test_no_manifest_holds_a_real_looking_secret(docs):
    assert not secret_problems(docs)


def test_the_agent_is_one_per_gpu_node_with_its_node_name_and_state_on_the_host(docs):
    ((_, ds),) = list(_of(docs, "DaemonSet"))
    spec = _pod(ds)["spec"]
    (agent,) = spec["containers"]
    env = {v["name"]: v for v in agent["env"]}
    assert env["GPUFLEET_AGENT_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert "nvidia.com/gpu.present" in spec["nodeSelector"]
    state = settings_from(container_env(docs, _ns(ds), agent)).state_dir
    host_dirs = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounted = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    assert mounted.get(str(state)) in host_dirs, f"the state dir {state} is not on the host"
    # ranks live in the agent's cgroup: a restart (liveness, rolling update) or an OOM kill ends them
    assert "livenessProbe" not in agent
    assert set(agent["resources"].get("limits", {})) <= {"nvidia.com/gpu"}
    assert ds["spec"]["updateStrategy"]["type"] == "OnDelete"


Mutation = Callable[[list[tuple[str, Doc]]], None]


def _find(docs: list[tuple[str, Doc]], kind: str, name: str) -> Doc:
    return next(d for _, d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _container(docs: list[tuple[str, Doc]], kind: str, name: str) -> Doc:
    return _pod(_find(docs, kind, name))["spec"]["containers"][0]


def _env(c: Doc, name: str) -> Doc:
    return next(v for v in c["env"] if v["name"] == name)


def _wrong_port(d):
    _container(d, "Deployment", "gpufleet-api")["ports"][0]["containerPort"] = 8001


def _unknown_setting(d):
    _container(d, "Deployment", "gpufleet-api")["env"].append({"name": "GPUFLEET_API_PROT", "value": "8000"})


def _missing_secret(d):
    _env(_container(d, "Deployment", "gpufleet-control"), "GPUFLEET_DATABASE_URL")["valueFrom"]["secretKeyRef"][
        "name"
    ] = "gpufleet-db"


def _real_secret(d):
    _find(d, "Secret", "gpufleet-database")["stringData"]["url"] = "postgresql://gpufleet:s3cretpass@pg:5432/gpufleet"


def _selector_miss(d):
    _find(d, "Service", "gpufleet-api")["spec"]["selector"]["app.kubernetes.io/component"] = "apis"


def _schema_error(d):
    _find(d, "Deployment", "gpufleet-api")["spec"]["replicas"] = "two"


def _wildcard_grpc(d):
    _env(_container(d, "Deployment", "gpufleet-control"), "GPUFLEET_CONTROL_GRPC_HOST")["value"] = "0.0.0.0"


def _bad_value(d):
    _find(d, "ConfigMap", "gpufleet-agent-settings")["data"]["GPUFLEET_AGENT_RUNTIME"] = "vm"


@pytest.mark.parametrize(
    "mutate, says",
    [
        (_wrong_port, "container ports"),
        (_unknown_setting, "is not a setting"),
        (_missing_secret, "not defined"),
        (_real_secret, "database URL with a password"),
        (_selector_miss, "matches no pods"),
        (_schema_error, "replicas"),
        (_wildcard_grpc, "advertised"),
        (_bad_value, "do not parse"),
    ],
)
def test_each_check_catches_its_breakage(docs, mutate: Mutation, says: str):
    broken = copy.deepcopy(docs)
    mutate(broken)
    problems = all_problems(broken)
    assert any(says in p for p in problems), problems
