"""Priority-class entitlement: which classes a team may submit in (admin write, audited),
and admission refusing the others before anything is written."""

from __future__ import annotations

import asyncpg
import pytest

from store.seed import DEMO_CLASSES, seed_demo
from tests.api.conftest import ADMIN, ALPHA, BETA, auth, new_key, submit

ALL = ["prod-serving", "prod-batch", "research", "preemptible"]


async def put_classes(client, body: dict, token: str = ADMIN, key: str | None = None, team: str = "alpha"):
    return await client.put(f"/v1/teams/{team}/priority-classes", json=body, headers=auth(token, key or new_key()))


async def test_a_team_without_an_entitlement_may_submit_in_every_class(client):
    r = await client.get("/v1/teams/alpha/priority-classes", headers=auth(ALPHA))
    assert r.status_code == 200, r.text
    assert r.json() == {"team": "alpha", "priority_classes": None, "allowed": ALL}
    for cls in ALL:
        r = await submit(client, priority_class=cls)
        assert r.status_code == 202, (cls, r.text)


async def test_a_restricted_team_is_refused_other_classes_and_nothing_is_written(client, pool):
    key = new_key()
    body = {"priority_classes": ["preemptible", "research", "research"], "reason": "research team"}
    r = await put_classes(client, body, key=key)
    assert r.status_code == 200, r.text
    # stored once each, in class order
    assert r.json() == {
        "team": "alpha",
        "priority_classes": ["research", "preemptible"],
        "allowed": ["research", "preemptible"],
    }
    again = await put_classes(client, body, key=key)
    assert again.json() == r.json() and again.headers["idempotent-replayed"] == "true"
    audit = await pool.fetch(
        "SELECT actor, subject, reason, detail FROM audit WHERE action = 'priority_classes_change'"
    )
    assert [(a["actor"], a["subject"], a["reason"]) for a in audit] == [("root", "alpha", "research team")]
    assert audit[0]["detail"] == {"old": None, "new": ["research", "preemptible"]}

    jobs_before = await pool.fetchval("SELECT count(*) FROM jobs WHERE team = 'alpha'")
    audits_before = await pool.fetchval("SELECT count(*) FROM audit")
    for cls in ("prod-serving", "prod-batch"):
        r = await submit(client, priority_class=cls)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "priority_class_not_allowed"
        assert err["message"].startswith(f"team alpha may submit in research, preemptible only, not {cls}")
        assert "PUT /v1/teams/alpha/priority-classes" in err["message"]
        assert err["details"] == {"priority_class": cls, "allowed": ["research", "preemptible"]}
    # an admin submitting for the team is held to the team's classes too
    assert (await submit(client, token=ADMIN, priority_class="prod-serving")).status_code == 403
    assert await pool.fetchval("SELECT count(*) FROM jobs WHERE team = 'alpha'") == jobs_before
    assert await pool.fetchval("SELECT count(*) FROM audit") == audits_before
    assert (await submit(client, priority_class="research")).status_code == 202
    assert (await submit(client, priority_class="preemptible")).status_code == 202

    # other teams are not affected
    assert (await submit(client, token=BETA, team="beta", priority_class="prod-serving")).status_code == 202

    # null lifts it
    r = await put_classes(client, {"priority_classes": None, "reason": "now runs production too"})
    assert r.status_code == 200 and r.json()["allowed"] == ALL and r.json()["priority_classes"] is None
    assert (await submit(client, priority_class="prod-serving")).status_code == 202
    last = await pool.fetchval(
        "SELECT detail FROM audit WHERE action = 'priority_classes_change' ORDER BY id DESC LIMIT 1"
    )
    assert last == {"old": ["research", "preemptible"], "new": None}


async def test_a_restriction_applies_to_new_submissions_not_to_queued_jobs(client, pool):
    job_id = (await submit(client, priority_class="prod-batch")).json()["job_id"]
    r = await put_classes(client, {"priority_classes": ["research"], "reason": "research only"})
    assert r.status_code == 200, r.text
    row = await pool.fetchrow("SELECT state, priority_class FROM jobs WHERE job_id = $1", job_id)
    assert (row["state"], row["priority_class"]) == ("QUEUED", "prod-batch")
    r = await client.get(f"/v1/jobs/{job_id}", headers=auth(ALPHA))
    assert r.status_code == 200 and r.json()["priority_class"] == "prod-batch"


async def test_who_may_read_and_set_a_teams_classes(client, pool):
    assert (await client.get("/v1/teams/alpha/priority-classes", headers=auth(BETA))).status_code == 403
    assert (await client.get("/v1/teams/alpha/priority-classes", headers=auth(ADMIN))).status_code == 200
    r = await put_classes(client, {"priority_classes": ["research"], "reason": "mine"}, token=ALPHA)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    r = await client.get("/v1/teams/ghosts/priority-classes", headers=auth(ADMIN))
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_team"
    # a team is not created by its classes (a typo would make a team): its first quota creates it
    r = await put_classes(client, {"priority_classes": ["research"], "reason": "new"}, team="ghosts")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_team"
    assert await pool.fetchval("SELECT count(*) FROM teams WHERE name = 'ghosts'") == 0
    assert await pool.fetchval("SELECT count(*) FROM audit WHERE action = 'priority_classes_change'") == 0


async def test_bad_bodies_are_refused_with_the_field_named(client, pool):
    for body in (
        {"priority_classes": [], "reason": "none"},  # an empty set would lock the team out: not by accident
        {"priority_classes": ["gold"], "reason": "no such class"},
        {"priority_classes": ["research"]},  # the reason is required
        {"reason": "which classes?"},  # null must be said, not implied
        {"priority_classes": ["research"], "reason": "x", "teams": ["beta"]},
        {"priority_classes": ALL + ["research"], "reason": "five"},
    ):
        r = await put_classes(client, body)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["error"]["code"], body
    assert await pool.fetchval("SELECT priority_classes FROM teams WHERE name = 'alpha'") is None


async def test_the_store_refuses_a_class_that_does_not_exist_or_an_empty_set(pool):
    """Postgres is the last line of defence: a write that skipped the API's schema still
    cannot store an unknown class, or an empty set that would lock the team out."""
    await pool.execute("INSERT INTO teams (name) VALUES ('gamma')")
    for bad in (["gold"], [], ["research"] * 5):
        with pytest.raises(asyncpg.CheckViolationError, match="priority_classes"):
            await pool.execute("UPDATE teams SET priority_classes = $1 WHERE name = 'gamma'", bad)
    assert await pool.fetchval("SELECT priority_classes FROM teams WHERE name = 'gamma'") is None
    await pool.execute("UPDATE teams SET priority_classes = $1 WHERE name = 'gamma'", ["research"])


async def test_the_demo_seed_gives_each_team_its_classes_once(pool):
    """`make up` shows the entitlement at work; a re-seed keeps what an admin changed."""
    async with pool.acquire() as conn:
        await seed_demo(conn, gpu_type="h100", blocks=1, nodes_per_block=2, gpus_per_node=8, task_queue_prefix="n-")
    rows = await pool.fetch("SELECT name, priority_classes FROM teams ORDER BY name")
    assert {r["name"]: tuple(r["priority_classes"]) for r in rows} == dict(DEMO_CLASSES)
    await pool.execute("UPDATE teams SET priority_classes = NULL WHERE name = 'research'")
    async with pool.acquire() as conn:  # again, and with a second GPU type (new quotas, not new teams)
        await seed_demo(conn, gpu_type="h100", blocks=1, nodes_per_block=2, gpus_per_node=8, task_queue_prefix="n-")
        await seed_demo(conn, gpu_type="a100", blocks=1, nodes_per_block=2, gpus_per_node=8, task_queue_prefix="n-")
    assert await pool.fetchval("SELECT priority_classes FROM teams WHERE name = 'research'") is None
    audit = await pool.fetch("SELECT actor, subject FROM audit WHERE action = 'priority_classes_change'")
    assert sorted((a["actor"], a["subject"]) for a in audit) == [("system:seed", t) for t in sorted(DEMO_CLASSES)]
