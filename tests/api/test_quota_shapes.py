"""PUT /v1/teams/{team}/quota takes two shapes: today's one GPU type with a reason, and the
requirements' map of GPU types (several at once, one transaction, each audited; the reason
defaults to "set by <admin>"). Bad bodies get a 422 that names the field."""

from __future__ import annotations

from tests.api.conftest import ADMIN, ALPHA, auth, new_key


async def put(client, body, team: str = "alpha", token: str = ADMIN):
    return await client.put(f"/v1/teams/{team}/quota", json=body, headers=auth(token, new_key()))


async def audit_rows(pool, subject_prefix: str = "alpha/"):
    return await pool.fetch(
        "SELECT actor, subject, reason, detail FROM audit WHERE action = 'quota_change' AND subject LIKE $1"
        " AND actor = 'root' ORDER BY id",
        subject_prefix + "%",
    )


async def test_the_map_shape_sets_several_gpu_types_in_one_request(client, pool):
    await pool.execute("INSERT INTO gpu_types (name) VALUES ('a100') ON CONFLICT DO NOTHING")
    r = await put(client, {"h100": {"guaranteed": 24, "borrow_limit": 8}, "a100": {"guaranteed": 4, "reason": "pilot"}})
    assert r.status_code == 200, r.text
    q = r.json()
    assert q["h100"]["guaranteed"] == 24 and q["h100"]["borrow_limit"] == 8
    assert q["a100"] == {"guaranteed": 4, "borrow_limit": 0, "in_use": 0, "borrowed": 0}  # new: borrow 0
    rows = {a["subject"]: a for a in await audit_rows(pool)}
    assert rows["alpha/h100"]["reason"] == "set by root"  # the default reason names the admin
    assert rows["alpha/h100"]["detail"]["old"] == {"guaranteed": 16, "borrow_limit": 16}
    assert rows["alpha/h100"]["detail"]["new"] == {"guaranteed": 24, "borrow_limit": 8}
    assert rows["alpha/a100"]["reason"] == "pilot"
    # the requirements' example as written: an unset borrow limit keeps the current one
    r = await put(client, {"h100": {"guaranteed": 3072}})
    assert r.status_code == 200 and r.json()["h100"] == {
        "guaranteed": 3072,
        "borrow_limit": 8,
        "in_use": 0,
        "borrowed": 0,
    }


async def test_todays_shape_still_works_and_needs_its_reason(client, pool):
    r = await put(client, {"gpu_type": "h100", "guaranteed": 12, "reason": "rebalance"})
    assert r.status_code == 200 and r.json()["h100"]["guaranteed"] == 12
    [row] = await audit_rows(pool)
    assert row["reason"] == "rebalance"
    r = await put(client, {"gpu_type": "h100", "guaranteed": 12})
    assert r.status_code == 422
    assert [d["loc"][-1] for d in r.json()["error"]["details"]] == ["reason"]


async def test_a_map_with_an_unknown_gpu_type_changes_nothing(client, pool):
    r = await put(client, {"h100": {"guaranteed": 2}, "tpu": {"guaranteed": 1}})
    assert r.status_code == 422 and r.json()["error"]["code"] == "unknown_gpu_type"
    assert "'tpu'" in r.json()["error"]["message"]
    q = (await client.get("/v1/teams/alpha/quota", headers=auth(ADMIN))).json()
    assert q["h100"]["guaranteed"] == 16 and await audit_rows(pool) == []  # one transaction: h100 untouched


async def test_bad_bodies_get_a_422_naming_the_field(client, pool):
    cases = [
        ({"h100": {"guaranteed": -1}}, ["h100", "guaranteed"]),
        ({"h100": {"borrow_limit": 4}}, ["h100", "guaranteed"]),
        ({"h100": {"guaranteed": 1, "burst": 2}}, ["h100", "burst"]),
        ({"h100": 5}, ["h100"]),
        ({}, []),
        ({"gpu_type": "h100", "guaranteed": "lots", "reason": "x"}, ["guaranteed"]),
        ([{"h100": {"guaranteed": 1}}], []),
    ]
    for body, field in cases:
        r = await put(client, body)
        assert r.status_code == 422, (body, r.text)
        err = r.json()["error"]
        assert err["code"] == "validation_error", (body, err)
        locs = [[str(x) for x in d["loc"]] for d in err["details"]]
        assert any(loc[-len(field) :] == field for loc in locs) if field else locs, (body, locs)
    # only admins write quotas, whatever the shape
    r = await put(client, {"h100": {"guaranteed": 1}}, token=ALPHA)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    assert await audit_rows(pool) == []
