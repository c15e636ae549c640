"""The job workflow's search attributes: what the Temporal UI filters histories by.

Registered on the namespace by ``common.temporal.ensure_search_attributes`` (control does it
at start; the embedded dev server is started with them); set at start by whoever starts the
workflow with ``JobLabels``, and kept current (state, attempt) by the workflow itself. A UI
query by team: ``GpufleetTeam = "pretrain"``; running gangs of 64 GPUs or more:
``GpufleetState = "RUNNING" AND GpufleetGpus >= 64``.
"""

from __future__ import annotations

from datetime import UTC, datetime

from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

from workflows.messages import JobLabels

TEAM = SearchAttributeKey.for_keyword("GpufleetTeam")
PRIORITY_CLASS = SearchAttributeKey.for_keyword("GpufleetPriorityClass")
GPU_TYPE = SearchAttributeKey.for_keyword("GpufleetGpuType")
GPUS = SearchAttributeKey.for_int("GpufleetGpus")
STATE = SearchAttributeKey.for_keyword("GpufleetState")
ATTEMPT = SearchAttributeKey.for_int("GpufleetAttempt")
SUBMITTED_AT = SearchAttributeKey.for_datetime("GpufleetSubmittedAt")

KEYS: tuple[SearchAttributeKey, ...] = (TEAM, PRIORITY_CLASS, GPU_TYPE, GPUS, STATE, ATTEMPT, SUBMITTED_AT)


def at_start(labels: JobLabels, state: str, attempt: int) -> TypedSearchAttributes:
    """Every attribute, as a starter sets them."""
    pairs: list[SearchAttributePair] = [
        SearchAttributePair(TEAM, labels.team),
        SearchAttributePair(PRIORITY_CLASS, labels.priority_class),
        SearchAttributePair(GPU_TYPE, labels.gpu_type),
        SearchAttributePair(GPUS, labels.gpus),
        SearchAttributePair(STATE, state),
        SearchAttributePair(ATTEMPT, attempt),
        SearchAttributePair(SUBMITTED_AT, datetime.fromtimestamp(labels.submitted_at, UTC)),
    ]
    return TypedSearchAttributes(pairs)
