"""TLS on the platform's three links (docs/security.md, "Network"), on the embedded stack:
the CLI's client to an API process serving HTTPS, agents to control's gRPC server, and the
API to an agent's log endpoint. A job is submitted, runs and has its output read back with
every link encrypted and each server's certificate checked against the platform's CA; a
client that does not trust the CA, or speaks plain text, gets nothing.

Certificates come from ``trustme`` (a throwaway CA, made per test)."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import time
import uuid

import httpx
import pytest
import trustme

from cli.api_cmd import start_apis, wait_listening
from cli.user_cmd import ApiClient, CliError
from common.embedded import any_free_port
from common.temporal import connect
from common.tls import client_verify
from tests.e2e.conftest import PY, e2e_settings, kill_ranks, seed_cluster
from tests.support import eventually

pytestmark = pytest.mark.e2e


def pem_files(tmp_path, ca: trustme.CA, name: str) -> tuple:
    """``name``'s certificate (with its chain) and key, issued by ``ca`` for 127.0.0.1 and localhost."""
    cert = ca.issue_cert("127.0.0.1", "localhost")
    chain, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    chain.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    key.write_bytes(cert.private_key_pem.bytes())
    key.chmod(0o600)
    return chain, key


def tls_settings(tmp_path, db_dsn, temporal_env):
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    api_cert, api_key = pem_files(tmp_path, ca, "api")
    control_cert, control_key = pem_files(tmp_path, ca, "control")
    agent_cert, agent_key = pem_files(tmp_path, ca, "agent")
    return e2e_settings(
        tmp_path, db_dsn, temporal_env.client.service_client.config.target_host,
        api_port=any_free_port(),
        api_tls_cert_file=api_cert, api_tls_key_file=api_key,
        control_tls=True, control_tls_cert_file=control_cert, control_tls_key_file=control_key,
        agent_tls_cert_file=agent_cert, agent_tls_key_file=agent_key,
        tls_ca_file=ca_file,
    )  # fmt: skip


def job_body(name: str) -> dict:
    return {
        "name": name, "team": "alpha", "priority_class": "research", "image": "registry/test:1",
        "command": [PY, "-c", "print('hello over tls')"], "gpu_type": "h100", "replicas": 1,
        "gpus_per_replica": 1, "max_runtime": "1h",
    }  # fmt: skip


async def test_a_job_runs_and_its_logs_come_back_with_every_link_encrypted(pool, db_dsn, temporal_env, tmp_path):
    from control.process import ControlProcess
    from worker_agent.agent import AgentProcess

    settings = tls_settings(tmp_path, db_dsn, temporal_env)
    nodes = await seed_cluster(pool, settings, nodes_per_block=1)
    client = await connect(settings)
    control = ControlProcess(settings, holder="c1", pool=pool, client=client)
    agent = AgentProcess(settings, nodes, backend="simulated")
    apis: dict[str, subprocess.Popen] = {}
    try:
        await control.start()
        await agent.start()
        assert agent.http_log_addr.startswith("https://127.0.0.1:")  # what heartbeats advertise
        # agents -> control over TLS: the node is linked and heartbeating
        link = agent.links[nodes[0]]
        await eventually(lambda: link.acks >= 2, timeout=30, what="heartbeats acknowledged over TLS")
        apis = start_apis(settings, 1, tmp_path)
        await asyncio.to_thread(wait_listening, apis, settings.api_port, 90, tmp_path)
        url = f"https://127.0.0.1:{settings.api_port}"
        api = ApiClient(url, "tok-alpha", retry_s=10, verify=client_verify(settings))

        job = await asyncio.to_thread(api.request, "POST", "/v1/jobs", json_body=job_body("tls"), write=True)
        job_id = job["job_id"]

        async def finished():
            got = await asyncio.to_thread(api.request, "GET", f"/v1/jobs/{job_id}")
            return got if got["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") else None

        done = await eventually(finished, timeout=60, interval=0.3, what="the job to finish")
        assert done["state"] == "SUCCEEDED", done
        # the API reads the rank's output from the agent's https endpoint, checking its certificate
        body = await asyncio.to_thread(lambda: b"".join(api.stream(f"/v1/jobs/{job_id}/logs", {"stream": "stdout"})))
        assert b"hello over tls" in body

        # a client without the platform's CA is told so at once, not retried for client_retry_s
        started = time.monotonic()
        with pytest.raises(CliError) as refused:
            await asyncio.to_thread(ApiClient(url, "tok-alpha", retry_s=30).request, "GET", f"/v1/jobs/{job_id}")
        assert refused.value.code == "untrusted_certificate" and "GPUFLEET_TLS_CA_FILE" in refused.value.message
        assert time.monotonic() - started < 10
        # plain HTTP to the HTTPS port gets no answer
        with pytest.raises(httpx.HTTPError):
            async with httpx.AsyncClient(timeout=5) as plain:
                (await plain.get(f"http://127.0.0.1:{settings.api_port}/v1/jobs/{job_id}")).raise_for_status()
    finally:
        for proc in apis.values():
            proc.kill()
            proc.wait(10)
        await agent.stop()
        await control.stop()
        kill_ranks(settings.state_dir)


async def test_an_agent_that_does_not_trust_control_or_speaks_plain_text_is_not_linked(
    pool, db_dsn, temporal_env, tmp_path
):
    from control.process import ControlProcess
    from worker_agent.agent import AgentProcess

    settings = tls_settings(tmp_path, db_dsn, temporal_env)
    nodes = await seed_cluster(pool, settings, nodes_per_block=2)
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    client = await connect(settings)
    control = ControlProcess(settings, holder="c1", pool=pool, client=client)
    # one agent trusts another CA, one speaks plain text; neither may link
    wrong_ca = AgentProcess(
        settings.model_copy(update={"tls_ca_file": other_ca, "state_dir": tmp_path / "a1"}), nodes[:1],
        backend="simulated",
    )  # fmt: skip
    plain = AgentProcess(
        settings.model_copy(update={"control_tls": False, "state_dir": tmp_path / "a2"}), nodes[1:],
        backend="simulated",
    )  # fmt: skip
    try:
        await control.start()
        await wrong_ca.start()
        await plain.start()
        links = [wrong_ca.links[nodes[0]], plain.links[nodes[1]]]
        await eventually(lambda: all(link.failures >= 2 for link in links), timeout=30, what="both links failing")
        assert [link.acks for link in links] == [0, 0]
        seen = await pool.fetchval(
            "SELECT count(*) FROM nodes WHERE node_id = ANY($1::text[]) AND agent_addr IS NOT NULL", nodes
        )
        assert seen == 0  # control never heard either node
    finally:
        await wrong_ca.stop()
        await plain.stop()
        await control.stop()
        kill_ranks(settings.state_dir)


def test_a_certificate_without_its_key_is_a_settings_error(tmp_path):
    from common.settings import Settings
    from common.tls import TlsSettingsError, grpc_channel_credentials, grpc_server_credentials, uvicorn_tls

    ca = trustme.CA()
    cert, _ = pem_files(tmp_path, ca, "x")
    with pytest.raises(TlsSettingsError, match="needs its key"):
        uvicorn_tls(Settings(api_tls_cert_file=cert))
    with pytest.raises(TlsSettingsError, match="control_tls needs"):
        grpc_server_credentials(Settings(control_tls=True))
    assert uvicorn_tls(Settings()) == {} and grpc_server_credentials(Settings()) is None
    bad_key = tmp_path / f"{uuid.uuid4().hex}.key"
    bad_key.write_text("not a key")
    with pytest.raises(TlsSettingsError, match="readable by others"):  # a private key is its owner's alone
        uvicorn_tls(Settings(api_tls_cert_file=cert, api_tls_key_file=bad_key))
    bad_key.chmod(0o600)
    with pytest.raises(TlsSettingsError, match="cannot load"):
        uvicorn_tls(Settings(api_tls_cert_file=cert, api_tls_key_file=bad_key))
    missing = Settings(tls_ca_file=tmp_path / "no-ca.pem", control_tls=True)
    with pytest.raises(TlsSettingsError, match="tls_ca_file: cannot load"):
        client_verify(missing)
    with pytest.raises(TlsSettingsError, match="tls_ca_file: cannot read"):
        grpc_channel_credentials(missing)


# --- Temporal ---------------------------------------------------------------------------------


async def tls_front(target: str, ctx: ssl.SSLContext) -> asyncio.base_events.Server:
    """A TLS-terminating front for the embedded Temporal dev server (which has no TLS of its own),
    as a Temporal frontend with a certificate, or Temporal Cloud, looks to a client."""
    host, _, port = target.rpartition(":")

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    return await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)


def front_context(tmp_path, ca: trustme.CA, client_ca: trustme.CA | None = None) -> ssl.SSLContext:
    cert, key = pem_files(tmp_path, ca, f"temporal-{uuid.uuid4().hex[:6]}")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    ctx.set_alpn_protocols(["h2"])  # gRPC
    if client_ca is not None:  # mutual TLS: a client certificate from client_ca or no session
        ctx.verify_mode = ssl.CERT_REQUIRED
        client_ca.configure_trust(ctx)
    return ctx


async def reaches(settings) -> bool:
    from common.temporal import connect

    try:
        client = await asyncio.wait_for(connect(settings), 30)
        return await asyncio.wait_for(client.service_client.check_health(), 30)
    except (RuntimeError, OSError, TimeoutError):
        return False


async def test_temporal_over_tls_checks_its_certificate(temporal_env, tmp_path):
    from common.settings import Settings

    ca = trustme.CA()
    ca_file = tmp_path / "temporal-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    front = await tls_front(temporal_env.client.service_client.config.target_host, front_context(tmp_path, ca))
    address = f"127.0.0.1:{front.sockets[0].getsockname()[1]}"
    try:
        base = Settings(temporal_address=address, temporal_tls=True, temporal_tls_ca_file=ca_file)
        assert await reaches(base)
        assert not await reaches(base.model_copy(update={"temporal_tls_ca_file": None}))  # not the system's CA
        assert not await reaches(base.model_copy(update={"temporal_tls": False}))  # plain text to a TLS port
    finally:
        front.close()


async def test_temporal_with_mutual_tls_needs_the_client_certificate(temporal_env, tmp_path):
    from common.settings import Settings

    server_ca, client_ca = trustme.CA(), trustme.CA()
    ca_file = tmp_path / "temporal-ca.pem"
    server_ca.cert_pem.write_to_path(str(ca_file))
    cert, key = pem_files(tmp_path, client_ca, "temporal-client")
    ctx = front_context(tmp_path, server_ca, client_ca=client_ca)
    front = await tls_front(temporal_env.client.service_client.config.target_host, ctx)
    address = f"127.0.0.1:{front.sockets[0].getsockname()[1]}"
    try:
        base = Settings(temporal_address=address, temporal_tls=True, temporal_tls_ca_file=ca_file)
        assert await reaches(base.model_copy(update={"temporal_tls_cert_file": cert, "temporal_tls_key_file": key}))
        assert not await reaches(base)  # no client certificate: no session
    finally:
        front.close()
