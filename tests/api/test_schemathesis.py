"""Schemathesis against the app's own OpenAPI, in-process (ASGI) with a real database
and the real Temporal dev server: no 5xx, and every response matches the schema
(status code documented, content type, body schema).

Bounded for a shared 2-core machine: a few dozen examples per operation, once with
random path parameters and once with ones that exist (so the happy paths run too).
The app runs its own lifespan in schemathesis' event loop thread (pool from
settings); the stand-in workflow worker keeps running on the test's loop.
"""

from __future__ import annotations

import asyncio

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hsettings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.python import asgi as schemathesis_asgi
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.main import create_app
from tests.api.conftest import ADMIN, ALPHA, auth
from tests.foundation.builders import queued_job
from workflows.messages import JOB_WORKFLOW, JobInput

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
POSITIVE_EXAMPLES = 20
NEGATIVE_EXAMPLES = 8

pytestmark = pytest.mark.slow


# Generated bodies that admission would reject almost always are patched with values
# that exist on the test cluster, so the accepted paths are fuzzed too.
VALID = {
    "POST /v1/jobs": {
        "team": "alpha",
        "priority_class": "research",
        "image": "registry/fuzz:1",
        "gpu_type": "h100",
        "max_runtime": "1h",
        "replicas": 1,
        "gpus_per_replica": 1,
        "topology": {"pack": "any"},
    },
    "PUT /v1/teams/{team}/quota": {"gpu_type": "h100"},
    "POST /v1/jobs/{job_id}:extend": {"by": "30m"},
}


def _patched(label: str):
    def patch(case):
        if isinstance(case.body, dict):
            case.body = {**case.body, **VALID[label]}
        return case

    return patch


def _run_operation(operation, *, mode, examples, headers, statuses, path_parameters=None, patch=False) -> None:
    strategy = operation.as_strategy(generation_mode=mode, path_parameters=path_parameters)
    if patch:
        strategy = strategy.map(_patched(operation.label))

    @given(case=strategy)
    @hsettings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case) -> None:
        response = case.call_and_validate(headers=headers, checks=CHECKS)
        statuses.setdefault(operation.label, set()).add(response.status_code)

    run()


async def test_api_conforms_to_its_openapi_schema(settings, pool, cluster, worker, temporal_env, task_queue):
    async with pool.acquire() as conn:
        known_job = await queued_job(conn, "j-known", "alpha")
        running_job = await queued_job(conn, "j-running", "alpha")  # its workflow answers extend
    await temporal_env.client.start_workflow(JOB_WORKFLOW, JobInput(running_job), id=running_job, task_queue=task_queue)
    app = create_app(settings)  # no injected pool: the lifespan opens one from settings
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    known = {"job_id": known_job, "node_id": "b0-n1", "team": "alpha"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 13

    statuses: dict[str, set[int]] = {}

    def run_all() -> list[str]:
        failures = []
        for op in operations:
            names = {p.name for p in op.path_parameters}
            existing = {n: known[n] for n in names}
            if op.label == "POST /v1/jobs/{job_id}:extend":
                existing["job_id"] = running_job
            runs = [(GenerationMode.POSITIVE, POSITIVE_EXAMPLES, None, False)]
            if names:
                runs.append((GenerationMode.POSITIVE, POSITIVE_EXAMPLES, existing, False))
            if op.label in VALID:
                runs.append((GenerationMode.POSITIVE, POSITIVE_EXAMPLES, existing or None, True))
            runs.append((GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES, None, False))
            for mode, n, params, patch in runs:
                for token in (ADMIN, ALPHA):
                    try:
                        _run_operation(
                            op,
                            mode=mode,
                            examples=n,
                            headers=auth(token),
                            statuses=statuses,
                            path_parameters=params,
                            patch=patch,
                        )
                    except Unsatisfiable:
                        pass  # nothing to make invalid (no parameters, no body)
                    except Exception as e:  # collect every operation's failure, then report them all
                        failures.append(f"{op.label} [{mode.value}, {token}, {params}]: {e}")
        return failures

    try:
        failures = await asyncio.to_thread(run_all)
    finally:
        await asyncio.to_thread(schemathesis_asgi.shutdown_lifespans)
    assert not failures, "\n\n".join(failures)
    for label, seen in sorted(statuses.items()):
        print(f"{label}: {sorted(seen)}")
    # the happy paths ran, not only rejections
    assert 200 in statuses["GET /v1/jobs/{job_id}"] and 202 in statuses["DELETE /v1/jobs/{job_id}"]
    assert 200 in statuses["GET /v1/teams/{team}/queue"] and 202 in statuses["POST /v1/nodes/{node_id}:drain"]
    assert 202 in statuses["POST /v1/jobs"] and 200 in statuses["PUT /v1/teams/{team}/quota"]
    assert 200 in statuses["POST /v1/jobs/{job_id}:extend"]
