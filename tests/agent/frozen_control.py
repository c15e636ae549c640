"""A control heartbeat server in its own process, for tests that freeze it (SIGSTOP) as a stalled
leader would be frozen: ``python -m tests.agent.frozen_control PORT SECRET``. It leads (acks every
heartbeat, confirms the leases it hears of) and prints ``ready`` once it listens."""

from __future__ import annotations

import asyncio
import sys


async def main(port: int, secret: str) -> None:
    from common.settings import Settings
    from control.heartbeat_server import HeartbeatServer

    server = HeartbeatServer(Settings(agent_shared_secret=secret), host="127.0.0.1", port=port)

    def confirmed(node_id: str) -> list[str]:
        e = server.table.get(node_id)
        return e.lease_ids if e is not None else []

    server.confirmed_leases = confirmed
    await server.start()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
