"""`gpufleet agent ...`: run the node agent, inject simulated GPU faults, look at a node's ranks.

Mounted by cli/main.py (`gpufleet agent`); also runnable as `python -m cli.agent_cmd`.

    gpufleet agent run                        one node: GPUFLEET_AGENT_NODE_ID or the hostname
    gpufleet agent run --nodes a,b,c          these nodes (simulated unless the backend is real)
    gpufleet agent run --simulate 16          16 simulated nodes node-000..node-015 in one process
    gpufleet agent inject-fault --node node-003 --gpu 2 --xid 79
    gpufleet agent inject-fault --node node-003 --gpu 2 --ecc dbe | --hang | --slow 0.5 | --link 4 | --clear
    gpufleet agent ps --node node-003         the node's leases from its state dir
"""

from __future__ import annotations

import json
import logging
import socket
import sys

import typer

agent_app = typer.Typer(
    help="the node agent: run it, inject simulated faults, list a node's ranks", no_args_is_help=True
)


def _settings():
    from common.settings import Settings

    return Settings()


def _node_ids(settings, simulate: int, nodes: str) -> list[str]:
    given = [n.strip() for n in nodes.split(",") if n.strip()]
    if simulate:
        if given:
            if len(given) < simulate:
                raise typer.BadParameter(f"--nodes names {len(given)} nodes but --simulate asks for {simulate}")
            return given[:simulate]
        return [f"node-{i:03d}" for i in range(simulate)]
    if given:
        return given
    return [settings.agent_node_id or socket.gethostname().split(".")[0]]


@agent_app.command("run")
def run(
    simulate: int = typer.Option(0, "--simulate", help="host N simulated nodes in this process (simulated NVML)"),
    nodes: str = typer.Option("", "--nodes", help="comma-separated node ids to host"),
    backend: str | None = typer.Option(
        None, "--backend", help="real | simulated (default: GPUFLEET_AGENT_NVML_BACKEND)"
    ),
    control: str | None = typer.Option(None, "--control", help="comma-separated control gRPC addresses"),
    temporal_address: str | None = typer.Option(
        None, "--temporal-address", help="Temporal frontend (default: settings)"
    ),
    no_temporal: bool = typer.Option(False, "--no-temporal", help="heartbeats and reports only, no Temporal workers"),
    listen: str | None = typer.Option(
        None, "--listen", help="where rank logs are served, host:port (default: GPUFLEET_AGENT_HTTP_LISTEN)"
    ),
    boot_id: str | None = typer.Option(None, "--boot-id", hidden=True, help="pretend this boot id (reboot tests)"),
    log_level: str = typer.Option("INFO", "--log-level"),
) -> None:
    """Run the agent until SIGTERM/SIGINT; running ranks are left running (a restart re-adopts them)."""
    import asyncio
    import signal

    from common.temporal import hard_exit

    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    settings = _settings()
    node_ids = _node_ids(settings, simulate, nodes)
    kind = "simulated" if simulate else (backend or settings.agent_nvml_backend)
    from common.embedded import PlatformError
    from common.secrets import require_production_ready

    try:
        require_production_ready(settings, "agent", node_ids)
    except PlatformError as e:
        print(f"gpufleet agent: {e}", file=sys.stderr)
        hard_exit(2)

    async def main() -> int:
        from worker_agent.agent import AgentProcess
        from worker_agent.node_lock import NodeLockHeld
        from worker_agent.nvml import NvmlUnavailable
        from worker_agent.rank_access import RankAccessError

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        agent = AgentProcess(
            settings,
            node_ids,
            backend=kind,
            boot_id=boot_id,
            temporal=not no_temporal,
            temporal_address=temporal_address,
            control_addresses=[a.strip() for a in control.split(",") if a.strip()] if control else None,
            listen=listen,
        )
        try:
            await agent.start()
        except (NvmlUnavailable, RankAccessError, NodeLockHeld) as e:
            print(f"gpufleet agent: {e}", file=sys.stderr)
            return 2
        print(
            json.dumps(
                {
                    "agent": "up",
                    "nodes": node_ids,
                    "backend": kind,
                    "http_log_addr": agent.http_log_addr,
                }
            ),
            flush=True,
        )
        await stop.wait()
        await agent.stop()
        return 0

    code = 1
    try:
        code = asyncio.run(main())
    except (ValueError, OSError) as e:
        print(f"gpufleet agent: {e}", file=sys.stderr)
        code = 2
    finally:
        hard_exit(code)  # docs/design.md, Known pitfalls: temporalio may crash at interpreter exit


@agent_app.command("inject-fault")
def inject_fault(
    node: str = typer.Option(..., "--node", help="simulated node id"),
    gpu: int | None = typer.Option(None, "--gpu", help="GPU index (default: every GPU)"),
    xid: int | None = typer.Option(None, "--xid", help="an Xid error, e.g. 79 (fallen off the bus)"),
    ecc: str | None = typer.Option(None, "--ecc", help="sbe (corrected) or dbe (uncorrected, fatal)"),
    hang: bool = typer.Option(False, "--hang", help="GPU hangs: utilization 0, the ranks' steps freeze"),
    slow: float | None = typer.Option(None, "--slow", help="slow GPU: throughput factor, e.g. 0.5"),
    link: int | None = typer.Option(None, "--link", help="NVLink number that goes down"),
    clear: bool = typer.Option(False, "--clear", help="clear the GPU's faults"),
) -> None:
    """Inject a fault into a simulated node; it shows in the node's next heartbeat."""
    from worker_agent.nvml import write_fault

    if ecc is not None and ecc not in ("sbe", "dbe"):
        raise typer.BadParameter("--ecc is sbe or dbe")
    if not (clear or hang or xid is not None or ecc or slow is not None or link is not None):
        raise typer.BadParameter("name a fault: --xid, --ecc, --hang, --slow, --link or --clear")
    settings = _settings()
    fault = {"gpu": gpu, "xid": xid, "ecc": ecc, "hang": hang, "slow": slow, "link": link, "clear": clear}
    path = write_fault(settings.state_dir, node, **fault)
    print(
        json.dumps(
            {"node": node, "fault": {k: v for k, v in fault.items() if v not in (None, False)}, "file": str(path)}
        )
    )


@agent_app.command("ps")
def ps(node: str = typer.Option(..., "--node", help="node id")) -> None:
    """The node's leases as its state dir records them (one JSON object per line)."""
    from worker_agent import statefiles as sf

    settings = _settings()
    root = sf.leases_dir(settings.state_dir, node)
    if not root.is_dir():
        return
    for d in sorted(root.iterdir()):
        task = sf.read_json(d / sf.TASK)
        if task is None:
            continue
        sup = sf.read_json(d / sf.SUPERVISOR) or {}
        ex = sf.read_json(d / sf.EXIT)
        progress = sf.read_json(d / sf.PROGRESS) or {}
        print(json.dumps({
            "lease_id": task["lease_id"], "job_id": task["job_id"], "attempt": task["attempt"], "rank": task["rank"],
            "epoch": (sf.read_json(d / sf.EPOCH) or {}).get("epoch", task["epoch"]), "pid": sup.get("rank_pid"),
            "state": ex["state"] if ex else "RUNNING", "exit_code": (ex or {}).get("exit_code"),
            "step": progress.get("step"), "checkpoint_uri": progress.get("checkpoint_uri"),
        }))  # fmt: skip


if __name__ == "__main__":
    agent_app(prog_name="gpufleet agent")
