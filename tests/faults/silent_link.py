"""A TCP path to Postgres that a test can make go silent, the way a database host that
vanished does: no RST, no FIN, the connections stay open and nothing answers on them.

This is what clients of a Postgres on another machine see when that machine loses power or
its network, or when a failover moves the database's address to a new host (which knows
nothing of the old connections): a client waiting for a reply waits for ever unless it has
a deadline of its own, since with nothing left to send its kernel never gives up. Killing a
local server, as the other fault tests do, closes its sockets and hides this.

    link = SilentLink(db_dsn); await link.start()
    dsn = link.dsn                  # give this to the processes under test
    link.go_silent()                # every connection open now stops answering, none closes;
                                    # new connections reach the server (the new host)
    await link.close()
"""

from __future__ import annotations

import asyncio
from urllib.parse import parse_qs, urlsplit, urlunsplit


class SilentLink:
    def __init__(self, dsn: str) -> None:
        parts = urlsplit(dsn)
        self._dsn_parts = parts
        host = parse_qs(parts.query).get("host", [parts.hostname or "127.0.0.1"])[0]
        self._port = parts.port or 5432
        self._unix = host if host.startswith("/") else None
        self._host = host
        self._era = 0  # connections of an earlier era are silent
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.port = 0

    @property
    def dsn(self) -> str:
        """The target's DSN with its host replaced by this link."""
        p = self._dsn_parts
        user = p.username or "postgres"
        auth = f"{user}:{p.password}@" if p.password else f"{user}@"
        return urlunsplit((p.scheme, f"{auth}127.0.0.1:{self.port}", p.path, "", ""))

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def go_silent(self) -> None:
        """From now on nothing passes on any connection open now, in either direction."""
        self._era += 1

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        era = self._era
        self._writers.append(client_w)
        try:
            if self._unix is not None:
                server_r, server_w = await asyncio.open_unix_connection(f"{self._unix}/.s.PGSQL.{self._port}")
            else:
                server_r, server_w = await asyncio.open_connection(self._host, self._port)
        except OSError:
            client_w.close()
            return
        self._writers.append(server_w)
        for src, dst in ((client_r, server_w), (server_r, client_w)):
            task = asyncio.create_task(self._pump(src, dst, era))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, era: int) -> None:
        try:
            while data := await src.read(65536):
                if self._era != era:
                    return  # silent: drop this and all that follows, close nothing
                dst.write(data)
                await dst.drain()
            dst.close()  # a clean end passes on while the link still speaks
        except (ConnectionError, OSError):
            dst.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        for w in self._writers:
            w.close()
        if self._server is not None:
            await self._server.wait_closed()
