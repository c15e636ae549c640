"""Recent demand per team, as plain data for ``ClusterState.set_demand_forecast``.

The engine has no clock, so it cannot remember what each team asked for a while ago.
A driver (the simulator, the live leader) feeds ``DemandWindow`` each team's demand
(GPUs running + queued) with the time, as it sees it, and before a cycle hands the
engine ``peaks(now)``: each team's highest demand over the last ``window_s``. A team
that used its guarantee recently and now uses less is likely to want it back soon;
``Policy.unsaved_borrow_guard`` keeps that much free from borrowed jobs that would lose
all their work when reclaimed.

Buckets of ``bucket_s`` keep it cheap: one max per (team, type) per bucket, at most
``window_s / bucket_s + 1`` buckets held.

``DemandForecast`` is what a driver keeps: the per-team window, and per GPU type a window of
all teams' demand within their guarantees together (``Policy.pooled_demand_forecast``
reads its peak: teams rarely peak at once, so the sum of their own peaks overstates what
comes back together).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from placement.ordering import JobQueue
    from placement.state import ClusterState


class DemandWindow:
    def __init__(self, window_s: float = 1800.0, bucket_s: float = 300.0) -> None:
        if window_s <= 0 or bucket_s <= 0:
            raise ValueError("window_s and bucket_s must be > 0")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._buckets: deque[tuple[int, dict[tuple[str, str], int]]] = deque()
        self._last: dict[tuple[str, str], int] = {}  # the latest observation: it holds until the next
        # the peaks of every bucket but the newest (the only one ``observe`` changes); None
        # once a bucket comes or goes. Saves re-reading the window every cycle.
        self._older: dict[tuple[str, str], int] | None = None

    def observe(self, now: float, demand: Mapping[tuple[str, str], int]) -> None:
        """Each (team, type)'s demand at ``now`` (times must not go backwards; a (team, type)
        left out has none). The demand seen last held until now, so a new bucket starts
        from it."""
        b = int(now // self.bucket_s)
        if not self._buckets or self._buckets[-1][0] != b:
            self._buckets.append((b, dict(self._last)))
            self._older = None
            self._trim(b)
        cur = self._buckets[-1][1]
        for k, v in demand.items():
            if v > cur.get(k, 0):
                cur[k] = v
        self._last = {k: v for k, v in demand.items() if v > 0}

    def _trim(self, b: int) -> None:
        oldest = b - int(self.window_s // self.bucket_s)
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()
            self._older = None

    def peaks(self, now: float) -> dict[tuple[str, str], int]:
        """The highest demand of each (team, type) over about the last ``window_s``."""
        self._trim(int(now // self.bucket_s))
        out: dict[tuple[str, str], int] = dict(self._last)  # it still holds
        if not self._buckets:
            return out
        older = self._older
        if older is None:
            older = self._older = {}
            for i in range(len(self._buckets) - 1):
                _merge_max(older, self._buckets[i][1])
        _merge_max(out, older)
        _merge_max(out, self._buckets[-1][1])
        return out


class DemandForecast:
    """Both forecasts, fed together: ``observe`` each cycle, then ``apply`` to the state."""

    def __init__(self, window_s: float = 1800.0, bucket_s: float = 300.0) -> None:
        self.teams = DemandWindow(window_s, bucket_s)
        self.pooled = DemandWindow(window_s, bucket_s)  # keyed (GPU type, "")

    def observe(self, now: float, state: ClusterState, demand: Mapping[tuple[str, str], int]) -> None:
        """Each (team, type)'s demand at ``now`` (``demand_of``), and per type the sum of every
        team's demand up to its guarantee."""
        self.teams.observe(now, demand)
        self.pooled.observe(now, {(t, ""): v for t, v in guaranteed_demand(state, demand).items()})

    def apply(self, state: ClusterState, now: float) -> None:
        state.set_demand_forecast(self.teams.peaks(now), pooled={t: v for (t, _), v in self.pooled.peaks(now).items()})


def guaranteed_demand(state: ClusterState, demand: Mapping[tuple[str, str], int]) -> dict[str, int]:
    """Per GPU type, all teams' demand within their guarantees, together."""
    out: dict[str, int] = {}
    for (team, t), v in demand.items():
        g = state.quota(team, t).guaranteed
        if g and v > 0:
            out[t] = out.get(t, 0) + min(g, v)
    return out


def _merge_max(into: dict[tuple[str, str], int], d: Mapping[tuple[str, str], int]) -> None:
    """``into`` takes each positive value of ``d`` above its own (max is associative, so the
    window's peaks can be merged bucket by bucket or from a partial merge)."""
    for k, v in d.items():
        if v > into.get(k, 0):
            into[k] = v


def demand_of(state: ClusterState, queue: JobQueue) -> dict[tuple[str, str], int]:
    """Each (team, type)'s demand now: GPUs it uses plus the GPUs of its queued jobs (one pass
    over the queue: the leader calls it once per cycle, only under the guard)."""
    out: dict[tuple[str, str], int] = {}
    for team in state.teams():
        for t in state.gpu_types():
            used = state.used(team, t)
            if used:
                out[(team, t)] = used
    for (_rank, team, t, _floor), lane in queue.lanes().items():
        n = 0
        for _, jid in lane:
            job = queue.get(jid)
            if job is not None:
                n += job.total_gpus
        out[(team, t)] = out.get((team, t), 0) + n
    return out
