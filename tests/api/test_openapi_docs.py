"""The OpenAPI document describes what users send and read: every field of a job's spec
(recursively), of the job, quota and queue views, with a full POST /v1/jobs example that
the demo cluster accepts."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from api.main import create_app
from api.schemas import JOB_SUBMIT_EXAMPLE, JobSubmit
from common.settings import Settings
from store.seed import DEMO_CLASSES, DEMO_TEAMS

DEMO_GPUS = 4 * 4 * 8  # `make up`: 4 blocks x 4 nodes x 8 h100


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    import asyncio

    async def fetch() -> dict[str, Any]:
        app = create_app(Settings(database_url="postgresql://unused/unused"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as c:
            r = await c.get("/openapi.json")
            assert r.status_code == 200
            return r.json()

    return asyncio.run(fetch())


def _resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _nested(doc: dict[str, Any], schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The object schemas a property leads to (through $ref, anyOf/oneOf, arrays and maps)."""
    out: list[dict[str, Any]] = []
    stack = [schema]
    while stack:
        s = _resolve(doc, stack.pop())
        if s.get("properties"):
            out.append(s)
        for k in ("anyOf", "oneOf", "allOf"):
            stack.extend(s.get(k, []))
        for k in ("items", "additionalProperties"):
            if isinstance(s.get(k), dict):
                stack.append(s[k])
    return out


def undocumented(doc: dict[str, Any], name: str) -> list[str]:
    """Fields of a component (and of every object it nests) without a description."""
    missing: list[str] = []
    seen: set[int] = set()
    stack = [(name, doc["components"]["schemas"][name])]
    while stack:
        path, schema = stack.pop()
        if id(schema) in seen:
            continue
        seen.add(id(schema))
        for field, prop in schema.get("properties", {}).items():
            if not (prop.get("description") or _resolve(doc, prop).get("description")):
                missing.append(f"{path}.{field}")
            stack.extend((f"{path}.{field}", s) for s in _nested(doc, prop))
    return sorted(missing)


def test_every_field_of_a_job_spec_is_described(openapi):
    assert undocumented(openapi, "JobSubmit") == []
    props = openapi["components"]["schemas"]["JobSubmit"]["properties"]
    assert "MASTER_ADDR" in props["command"]["description"]  # says what a rank receives
    # and the nested objects' own fields
    topo = _resolve(openapi, props["topology"])
    assert {"pack", "max_blocks", "max_blocks_wait_seconds"} <= set(topo["properties"])


@pytest.mark.parametrize(
    "name",
    ["JobSummary", "JobList", "SubmitAccepted", "QuotaEntry", "QuotaSet", "QuotaLimits", "QueueEntry", "TeamQueue"],
)
def test_the_views_users_read_are_described(openapi, name):
    assert undocumented(openapi, name) == []


def test_job_view_fields_are_described(openapi):
    assert undocumented(openapi, "JobView") == []


def test_fields_carry_examples(openapi):
    schemas = openapi["components"]["schemas"]
    for name in ("JobSubmit", "QuotaSet", "QuotaLimits"):
        without = [
            f
            for f, p in schemas[name]["properties"].items()
            if "examples" not in p and "examples" not in _resolve(openapi, p) and "$ref" not in p
        ]
        assert without == [], (name, without)


def test_post_jobs_has_a_full_example_the_demo_cluster_accepts(openapi):
    body = openapi["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]
    [example] = _resolve(openapi, body["schema"])["examples"]
    assert example == JOB_SUBMIT_EXAMPLE
    job = JobSubmit.model_validate(example)  # the API's own validation
    assert set(example) == set(JobSubmit.model_fields) - {"topology"} | {"topology"}  # every field shown
    guaranteed, borrow = DEMO_TEAMS[job.team]
    assert job.priority_class in DEMO_CLASSES[job.team]
    gpus = job.replicas * job.gpus_per_replica
    assert job.gpu_type == "h100" and gpus <= DEMO_GPUS * (guaranteed + borrow)
    assert job.topology.pack == "block" and gpus <= 4 * 8 * (job.topology.max_blocks or 1)  # fits one block
    assert job.image.startswith("registry/")  # the default allowed registry


def test_the_quota_body_documents_both_shapes(openapi):
    put = openapi["paths"]["/v1/teams/{team}/quota"]["put"]["requestBody"]["content"]["application/json"]
    assert set(put["examples"]) == {"by_gpu_type", "single"}
    shapes = _resolve(openapi, put["schema"])["oneOf"]
    assert len(shapes) == 2
