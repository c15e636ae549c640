"""Input a hostile tenant sends to reach beyond its job: image references that a text
prefix let through, control and bidirectional-override characters in what operators
read (names, reasons) and what ranks run (commands, env), and env keys that change how
programs load or impersonate the platform. Each is a 422 naming the field, and nothing
is written."""

from __future__ import annotations

import httpx
import pytest

from api.main import create_app
from tests.api.conftest import ADMIN, auth, new_key, submit
from tests.api.test_admission import nothing_written

RLO = "\u202e"  # right-to-left override
LRI = "\u2066"  # left-to-right isolate

REJECTED = [
    # (overrides, the field the error names, words in its message)
    ({"image": "registry/../evil"}, ["body", "image"], "'..'"),
    ({"image": "registry/"}, ["body", "image"], "(empty)"),
    ({"image": "registry/x y"}, ["body", "image"], "'x y'"),
    ({"image": "registry"}, ["body", "image"], "names no repository"),
    ({"image": "registry/llm:1@sha256:nothex"}, ["body", "image"], "digest"),
    ({"image": "registry/llm:-1"}, ["body", "image"], "tag"),
    ({"image": "registry/Llm:1"}, ["body", "image"], "'Llm'"),
    ({"name": f"train-{RLO}gnp.exe"}, ["body", "name"], "bidirectional"),
    ({"name": "train\x1b[2Jcleared"}, ["body", "name"], "control"),
    ({"name": "two\nlines"}, ["body", "name"], "control"),
    ({"command": ["python", f"train.py{LRI}"]}, ["body", "command", "1"], "bidirectional"),
    ({"command": ["python", "train.py\x1b]0;x\x07"]}, ["body", "command", "1"], "control"),
    ({"env": {"LR": f"0.1{RLO}"}}, ["body", "env", "LR"], "bidirectional"),
    ({"env": {"LR": "0.1\r"}}, ["body", "env", "LR"], "control"),
    ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, ["body", "env"], "LD_PRELOAD"),
    ({"env": {"GPUFLEET_API_TOKENS": "{}"}}, ["body", "env"], "GPUFLEET_API_TOKENS"),
    ({"env": {"PYTHONSTARTUP": "/tmp/x.py", "OK": "1"}}, ["body", "env"], "PYTHONSTARTUP"),
    ({"env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}}, ["body", "env"], "CUDA_VISIBLE_DEVICES"),
]


@pytest.mark.parametrize(("over", "loc", "words"), REJECTED, ids=[repr(c[0])[:60] for c in REJECTED])
async def test_rejected_input_is_422_naming_the_field(client, pool, over, loc, words):
    r = await submit(client, **over)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "validation_error"
    named = [d for d in err["details"] if d["loc"] == loc]
    assert named and words in named[0]["msg"], err
    await nothing_written(pool)


@pytest.mark.parametrize(
    "image",
    ["registry.evil/x:1", "registry.evil.example/llm:1", "evil/registry/llm:1", "registry:5000/llm:1"],
)
async def test_images_outside_the_allowed_registry_are_refused_by_host(client, pool, image):
    r = await submit(client, image=image)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "image_not_allowed" and err["details"] == {"field": "image"}
    assert image in err["message"]
    await nothing_written(pool)


async def test_a_repository_rule_matches_by_component(settings, pool, temporal_env, cluster):
    narrowed = settings.model_copy(update={"allowed_registries": ["registry/team-a"]})
    app = create_app(narrowed, pool=pool, temporal_client=temporal_env.client)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for image, status in (
            ("registry/team-a/llm:1", 202),
            ("registry/team-a:1", 202),
            ("registry/team-ab/llm:1", 422),  # a text prefix would have let this through
            ("registry/team/a:1", 422),
        ):
            r = await submit(c, token=ADMIN, image=image)
            assert r.status_code == status, (image, r.text)


async def test_what_scripts_need_is_accepted(client):
    r = await submit(
        client,
        image="registry/llm@sha256:" + "ab" * 32,
        command=["bash", "-c", "set -e\n\tpython train.py --lr 0.1"],
        env={"LR": "0.1", "NCCL_DEBUG": "INFO", "NOTE": "multi\nline", "PYTHONPATH": "/code"},
        name="résumé-ünïcode-名前",
    )
    assert r.status_code == 202, r.text


async def test_an_extension_reason_with_controls_is_refused(client, worker):
    job_id = (await submit(client)).json()["job_id"]
    r = await client.post(
        f"/v1/jobs/{job_id}:extend", json={"by": "1h", "reason": f"ok{RLO}"}, headers=auth(ADMIN, new_key())
    )
    assert r.status_code == 422 and r.json()["error"]["details"][0]["loc"] == ["body", "reason"], r.text
