"""The API's edge, as one pure ASGI middleware: request ids, the request size limit,
and the last line of defence that turns any escaped exception into the error shape
(logged here with its traceback; never sent to the client)."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from api.errors import error_body, request_id_var, translate_exception

log = logging.getLogger("gpufleet.api")

_REQUEST_ID_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


class EdgeMiddleware:
    def __init__(self, app: Any, max_request_bytes: int) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        rid = headers.get("x-request-id", "")
        if not rid or len(rid) > 64 or not set(rid) <= _REQUEST_ID_OK:
            rid = uuid.uuid4().hex
        token = request_id_var.set(rid)
        started = False

        async def send_wrapper(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", rid.encode())]
            await send(message)

        try:
            length = headers.get("content-length")
            if length is not None:
                try:
                    too_big = int(length) > self.max_request_bytes
                except ValueError:
                    await self._error(send_wrapper, 400, "bad_request", "Content-Length is not a number")
                    return
                if too_big:
                    await self._too_large(send_wrapper)
                    return
            elif scope.get("method") in ("POST", "PUT", "PATCH", "DELETE"):
                # Chunked body: read it up to the limit, then replay it to the app.
                body = bytearray()
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    body += msg.get("body", b"")
                    if len(body) > self.max_request_bytes:
                        await self._too_large(send_wrapper)
                        return
                    if not msg.get("more_body", False):
                        break
                receive = _replay(bytes(body), receive)
            try:
                await self.app(scope, receive, send_wrapper)
            except Exception as exc:  # the catch-all: no stack trace leaves the process
                mapped = translate_exception(exc)
                if mapped is None:
                    log.exception("unhandled error in %s %s (request %s)", scope.get("method"), scope.get("path"), rid)
                    mapped = (500, "internal_error", f"internal error; quote request id {rid}", None)
                else:
                    log.warning("%s %s: %s (%s)", scope.get("method"), scope.get("path"), mapped[1], exc)
                if not started:
                    await self._error(send_wrapper, *mapped)
        finally:
            request_id_var.reset(token)

    async def _too_large(self, send: Any) -> None:
        await self._error(
            send, 413, "request_too_large", f"the request body is larger than {self.max_request_bytes} bytes"
        )

    @staticmethod
    async def _error(send: Any, status: int, code: str, message: str, details: Any = None) -> None:
        payload = json.dumps(error_body(code, message, details)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
