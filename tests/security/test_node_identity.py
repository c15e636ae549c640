"""A node speaks only for itself (docs/design.md, Security): a report about a lease the store
assigns to another node is refused for good and audited, and its job does not move; per-node
credentials an admin issues replace the dev derivation for that node and can be revoked."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime

import grpc
import pytest

from common.contracts import TaskState, TaskStatus
from proto import agent_pb2 as pb
from proto import agent_pb2_grpc as pbg
from proto.auth import node_credential, node_log_key, node_metadata
from proto.convert import task_status_to_pb
from tests.e2e.conftest import PY
from tests.support import eventually, holds

ADMIN = "tok-admin"


async def open_stream(address: str, node_id: str, credential: str):
    """A raw agent stream: (call, send queue); the caller reads ``call`` for control messages."""
    channel = grpc.aio.insecure_channel(address)
    queue: asyncio.Queue = asyncio.Queue()

    async def outgoing():
        while True:
            msg = await queue.get()
            if msg is None:
                return
            yield msg

    call = pbg.ControlLinkStub(channel).Connect(outgoing(), metadata=node_metadata(node_id, credential))
    return channel, call, queue


async def refused_for_good(address: str, node_id: str, credential: str) -> bool:
    channel, call, queue = await open_stream(address, node_id, credential)
    try:
        await queue.put(pb.AgentMessage(heartbeat=pb.Heartbeat(node_id=node_id, boot_id="x", seq=1)))
        await call.read()
        return False
    except grpc.aio.AioRpcError as e:
        return e.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await queue.put(None)
        await channel.close()


@pytest.mark.parametrize("stack_overrides", [{"node_credentials_refresh_s": 0.2}])
async def test_a_report_about_another_nodes_lease_is_refused_and_audited(stack):
    job = await stack.submit(command=[PY, "-c", "import time; time.sleep(60)"])
    await stack.wait_state(job, "RUNNING")
    lease = await stack.pool.fetchrow("SELECT * FROM leases WHERE job_id = $1 AND state = 'live'", job)
    victim_node = lease["node_id"]
    forger = next(n for n in stack.nodes if n != victim_node)
    address = stack.controls[0].heartbeats.address
    channel, call, queue = await open_stream(address, forger, node_credential(stack.settings, forger))
    try:
        forged = TaskStatus(
            node_id=forger, lease_id=lease["lease_id"], job_id=job, attempt=lease["attempt"], epoch=lease["epoch"],
            rank=0, state=TaskState.EXITED, at=datetime.now(UTC), exit_code=0, seq=7,
        )  # fmt: skip
        await queue.put(pb.AgentMessage(task_status=task_status_to_pb(forged)))
        while True:
            msg = await asyncio.wait_for(call.read(), 10)
            if msg.WhichOneof("body") == "task_status_ack":
                break
        ack = msg.task_status_ack
        assert ack.refused and not ack.ok and victim_node in ack.error
    finally:
        await queue.put(None)
        await channel.close()

    async def audited():
        return await stack.pool.fetchrow("SELECT * FROM audit WHERE action = 'security_event' AND subject = $1", forger)

    row = await eventually(audited, timeout=5, what="the security event")
    assert row["detail"]["lease_id"] == lease["lease_id"] and row["detail"]["owner"] == victim_node
    # the job did not move: still RUNNING on its node, its GPU still its own
    await holds(
        lambda: stack.pool.fetchval("SELECT state = 'RUNNING' FROM jobs WHERE job_id = $1", job),
        for_s=2.0,
        what="the job RUNNING",
    )
    assert await stack.pool.fetchval("SELECT count(*) FROM allocations WHERE job_id = $1", job) == 1


@pytest.mark.parametrize("stack_overrides", [{"node_credentials_refresh_s": 0.2}])
async def test_an_issued_credential_replaces_the_derived_one_and_a_revoked_one_is_refused(stack):
    node = stack.nodes[-1]
    address = stack.controls[0].heartbeats.address
    derived = node_credential(stack.settings, node)
    assert not await refused_for_good(address, node, derived)  # dev: the derived credential works

    def admin():
        return {"Authorization": f"Bearer {ADMIN}", "Idempotency-Key": uuid.uuid4().hex}

    r = await stack.http.post(f"/v1/nodes/{node}:issue-credential", json={"reason": "provision"}, headers=admin())
    assert r.status_code == 201, r.text
    issued = r.json()["credential"]
    assert issued and issued != derived
    # with it, the node's log key: derived from the API's signing key, which the node never holds
    assert r.json()["log_key"] == node_log_key(stack.settings.log_signing_key, node)
    stored = await stack.pool.fetchval("SELECT credential_sha256 FROM node_credentials WHERE node_id = $1", node)
    assert issued not in stored  # only a digest is kept
    assert not await refused_for_good(address, node, issued)
    assert await refused_for_good(address, node, derived)  # once issued, the derivation no longer counts
    # a replay of the request does not show the credential again
    key = uuid.uuid4().hex
    headers = {"Authorization": f"Bearer {ADMIN}", "Idempotency-Key": key}
    first = await stack.http.post(f"/v1/nodes/{node}:issue-credential", json={"reason": "rotate"}, headers=headers)
    again = await stack.http.post(f"/v1/nodes/{node}:issue-credential", json={"reason": "rotate"}, headers=headers)
    rotated = first.json()["credential"]
    assert again.headers["idempotent-replayed"] == "true" and again.json()["credential"] is None
    assert again.json()["log_key"] is None
    assert rotated not in str(await stack.pool.fetch("SELECT response_body FROM idempotency_keys"))
    # rotated away (control re-reads the credentials every node_credentials_refresh_s)
    await eventually(lambda: refused_for_good(address, node, issued), timeout=5, what="the rotated credential refused")
    r = await stack.http.post(f"/v1/nodes/{node}:revoke-credential", json={"reason": "stolen"}, headers=admin())
    assert r.status_code == 200 and r.json()["revoked"] is True
    t0 = time.monotonic()
    await eventually(lambda: refused_for_good(address, node, rotated), timeout=5, what="the revoked credential refused")
    assert time.monotonic() - t0 < 5
    actions = [r["action"] for r in await stack.pool.fetch("SELECT action FROM audit WHERE subject = $1", node)]
    assert actions.count("node_credential_issue") == 2 and "node_credential_revoke" in actions
    assert "security_event" in actions  # the refused streams are audited


async def test_a_heartbeat_claiming_another_nodes_rank_is_not_believed_and_audited(stack):
    job = await stack.submit(command=[PY, "-c", "import time; time.sleep(60)"])
    await stack.wait_state(job, "RUNNING")
    lease = await stack.pool.fetchrow("SELECT * FROM leases WHERE job_id = $1 AND state = 'live'", job)
    forger = next(n for n in stack.nodes if n != lease["node_id"])
    address = stack.controls[0].heartbeats.address
    channel, _call, queue = await open_stream(address, forger, node_credential(stack.settings, forger))
    boot = stack.agent.boot_id or "forged"

    async def beat_and_check():
        seq = int(time.time() * 1000)  # heartbeats' seq is ms-based, like the agent's
        running = pb.RunningLease(lease_id=lease["lease_id"], job_id=job, epoch=lease["epoch"], attempt=1, rank=0)
        await queue.put(pb.AgentMessage(heartbeat=pb.Heartbeat(node_id=forger, boot_id=boot, seq=seq,
                                                               running=[running])))  # fmt: skip
        return await stack.pool.fetchrow(
            "SELECT * FROM audit WHERE action = 'security_event' AND subject = $1 AND detail->>'lease_id' = $2",
            forger,
            lease["lease_id"],
        )

    try:
        row = await eventually(beat_and_check, timeout=15, interval=0.3, what="the security event")
        assert row["detail"]["owner"] == lease["node_id"]
    finally:
        await queue.put(None)
        await channel.close()
    assert (await stack.job(job))["state"] == "RUNNING"
    assert await stack.pool.fetchval("SELECT state FROM leases WHERE lease_id = $1", lease["lease_id"]) == "live"
