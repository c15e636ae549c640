"""Tiny hand-built scenarios for the simulator tests."""

from __future__ import annotations

from placement import PRESETS, Policy
from sim.core import SimOptions, Simulation
from sim.failures import Fault
from sim.workload import ClusterSpec, SimJob, TeamSpec, Workload

HOUR = 3600.0


def job(jid: str, team: str, submit: float, work: float, *, gpus: int = 8, cls: str = "research", **kw) -> SimJob:
    """A job of ``gpus`` GPUs: one replica up to 8, whole 8-GPU nodes beyond."""
    if gpus <= 8:
        reps, gpr = 1, gpus
    else:
        reps, gpr = gpus // 8, 8
    kw.setdefault("max_runtime_s", work)
    return SimJob(
        job_id=jid, team=team, priority=cls, submit=submit, work_s=work, replicas=reps, gpus_per_replica=gpr, **kw
    )


def workload(
    jobs: list[SimJob],
    teams: dict[str, tuple[int, int]],
    *,
    blocks: int = 2,
    nodes_per_block: int = 4,
    end: float = 10 * HOUR,
) -> Workload:
    cluster = ClusterSpec.uniform(blocks * nodes_per_block, nodes_per_block)
    return Workload(
        cluster=cluster,
        teams=tuple(TeamSpec(name, (("h100", g, b),)) for name, (g, b) in teams.items()),
        jobs=tuple(sorted(jobs, key=lambda j: (j.submit, j.job_id))),
        end=end,
    )


def simulate(
    wl: Workload,
    policy: Policy | str = "gpufleet",
    faults: tuple[Fault, ...] = (),
    **opts,
) -> tuple[Simulation, dict]:
    pol = PRESETS[policy] if isinstance(policy, str) else policy
    opts.setdefault("check_every", 1)  # the engine's invariant checkers after every cycle
    opts.setdefault("keep_log", True)
    sim = Simulation(wl, pol, "test", faults, SimOptions(**opts))
    res = sim.run()
    return sim, res


def placement_of(sim: Simulation, job_id: str, attempt: int = 0):
    """The ``attempt``-th placement of a job in the run's plans (None if never placed)."""
    seen = 0
    for p in sim.plans:
        for pl in p.placements:
            if pl.job_id == job_id and not pl.replacement:
                if seen == attempt:
                    return p.now, pl
                seen += 1
    return None


def ended_at(sim: Simulation, job_id: str, outcome: str = "succeeded") -> float | None:
    """When the run's log first records ``job_id`` ending with ``outcome`` (None if never)."""
    for line in sim.log:
        if f"end {job_id} {outcome}" in line:
            return float(line.split()[0])
    return None


def preemptions(sim: Simulation) -> list:
    return [(p.now, pr) for p in sim.plans for pr in p.preemptions]
