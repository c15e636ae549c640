"""Invariant checkers for tests and the simulator (full scans: never call them in a cycle).

* ``check_state(state)``: indexes agree with a recomputation from scratch, no GPU is
  held twice, whole-node jobs own their nodes, gangs are complete (except degraded
  prod-serving), max_blocks is honoured, guaranteed usage <= guarantee.
* ``check_plan(state, plan, queue, policy)``: called with the state the plan was
  made from (before ``apply``): placements use free GPUs of ready nodes of the right
  type, no GPU twice, gangs all-or-nothing, whole nodes for >= node-size jobs,
  max_blocks, quota (guaranteed never above the guarantee, borrowed within the
  limit), victim rules (class, prod-serving never, 30-minute protection of guaranteed
  work, small higher-class borrowed work only after the wait, never the
  beneficiary's own team's borrowed work, daily budget except
  borrowed, borrowed-only beyond a guarantee, no preemption for borrowing), reserved
  nodes (a reservation that stood through the cycle: nodes cleared by preemption only
  for their beneficiary, head-of-line nodes only by ``may_use``'s rules or a claim),
  every considered job placed or given a reason.

Both return a list of human-readable violations (empty when all hold).
"""

from __future__ import annotations

import math

from placement import quota as quota_mod
from placement.model import SERVING_RANK, NodeHealth, Pack, Plan, Policy, Reservation, ReservationKind
from placement.ordering import JobQueue
from placement.reservations import evictable_for, may_use, owner_borrows
from placement.state import ClusterState, indices_of, mask_of
from placement.topology import job_shape


def check_state(
    state: ClusterState, strict_quota: bool = True, respect_topology: bool = True, soft_limits_lapse: bool = False
) -> list[str]:
    """``respect_topology`` False (``Policy.topology`` off) skips the max_blocks check;
    ``soft_limits_lapse`` (``Policy.spread_before_preempt``) skips it for block limits a job
    may outwait (``max_blocks_wait_s`` set), which such a policy may lift early."""
    errs: list[str] = []
    nodes = state._nodes
    # node masks vs jobs
    for nid, node in nodes.items():
        union = 0
        for jid, m in node.jobs.items():
            if union & m:
                errs.append(f"{nid}: GPUs {indices_of(union & m)} held twice")
            union |= m
            rj = state._running.get(jid)
            if rj is None:
                errs.append(f"{nid}: held by unknown job {jid}")
            elif rj.held.get(nid) != m:
                errs.append(f"{nid}: {jid} holds {indices_of(m)} on the node, job says {rj.held.get(nid)}")
        if union | node.free_mask != node.full or union & node.free_mask:
            errs.append(f"{nid}: free mask disagrees with holdings")
        if node.nfree != node.free_mask.bit_count():
            errs.append(f"{nid}: nfree wrong")
        if node.spare_of is not None and (node.jobs or node.health is not NodeHealth.READY):
            errs.append(f"{nid}: spare of {node.spare_of} but busy or not ready")
        for jid in node.jobs:
            rj = state._running.get(jid)
            if rj is not None and rj.whole and len(node.jobs) > 1:
                errs.append(f"{nid}: whole-node job {jid} shares the node with {sorted(node.jobs)}")
            if rj is not None and rj.whole and node.jobs[jid] != node.full:
                errs.append(f"{nid}: whole-node job {jid} does not hold the whole node")
    for jid, rj in state._running.items():
        for nid, m in rj.held.items():
            if nodes[nid].jobs.get(jid) != m:
                errs.append(f"{jid}: holds {nid} but the node disagrees")
            if nodes[nid].gpu_type != rj.gpu_type:
                errs.append(f"{jid}: runs on {nodes[nid].gpu_type}, needs {rj.gpu_type}")
        spec = rj.spec
        missing = state._missing.get(jid, set())
        if rj.rank != SERVING_RANK and missing:
            errs.append(f"{jid}: gang missing replicas {sorted(missing)}")
        if len(rj.slots) + len(missing) != spec.replicas:
            errs.append(f"{jid}: {len(rj.slots)} slots + {len(missing)} missing != {spec.replicas} replicas")
        for r, (nid, gpus) in rj.slots.items():
            if mask_of(gpus) & ~rj.held.get(nid, 0):
                errs.append(f"{jid}: replica {r} uses GPUs it does not hold")
        if not missing:
            held = {n: indices_of(m) for n, m in rj.held.items()}
            at = math.inf if soft_limits_lapse and rj.spec.topology.max_blocks_wait_s is not None else rj.started_at
            errs.extend(_shape_errors(state, jid, rj.spec, sorted(rj.held), held, respect_topology, at))
    # indexes
    for t, ti in state._types.items():
        buckets: list[list[str]] = [[] for _ in range(ti.node_gpus + 1)]
        free_gpus = free_nodes = un_g = un_n = sp_n = sp_g = 0
        blocks_free: dict[str, int] = {}
        for bid, blk in ti.blocks.items():
            fn = []
            for nid in blk.nodes:
                node = nodes[nid]
                if node.spare_of is not None:
                    sp_n += 1
                    sp_g += node.gpus
                    continue
                if node.health is not NodeHealth.READY:
                    un_g += node.nfree
                    un_n += node.nfree == node.gpus
                    continue
                if node.nfree:
                    buckets[node.nfree].append(nid)
                    free_gpus += node.nfree
                if node.nfree == node.gpus:
                    fn.append(nid)
            if fn != blk.free_nodes:
                errs.append(f"{bid}: free node index wrong")
            if fn:
                blocks_free[bid] = len(fn)
            free_nodes += len(fn)
        for f in range(1, ti.node_gpus + 1):
            if sorted(buckets[f]) != ti.buckets[f]:
                errs.append(f"{t}: bucket {f} wrong")
        if (free_gpus, free_nodes, un_g, un_n) != (
            ti.free_gpus,
            ti.free_nodes,
            ti.unready_idle_gpus,
            ti.unready_idle_nodes,
        ):
            errs.append(f"{t}: free totals wrong")
        if blocks_free != ti.blocks_free:
            errs.append(f"{t}: blocks_free wrong")
        if (sp_n, sp_g) != (ti.spare_nodes, ti.spare_gpus):
            errs.append(f"{t}: hot spare totals wrong")
        cats: dict[tuple[int, bool], list] = {}
        cat_g: dict[tuple[int, bool], int] = {}
        for jid, rj in state._running.items():
            if rj.gpu_type != t or rj.rank == SERVING_RANK or rj.preempting_for is not None:
                continue
            c = (rj.rank, rj.borrowed)
            if rj.vcat != c:
                errs.append(f"{jid}: victim category {rj.vcat} != {c}")
            if not rj.young:
                cats.setdefault(c, []).append((-rj.lost_since, jid))
            elif rj.started_at <= state._clock - state._protect_s and rj.vkey is not None:
                errs.append(f"{jid}: young and listed")
            cat_g[c] = cat_g.get(c, 0) + rj.charge
        for c in set(cats) | set(ti.victims):
            if sorted(cats.get(c, [])) != ti.victims.get(c, []):
                errs.append(f"{t}: victim list {c} wrong")
            if cat_g.get(c, 0) != ti.cat_gpus.get(c, 0):
                errs.append(f"{t}: victim GPUs {c} wrong")
    # accounting and quota
    acc: dict[tuple[str, str], list[int]] = {}
    for rj in state._running.values():
        a = acc.setdefault((rj.team, rj.gpu_type), [0, 0, 0])
        a[0] += rj.charge
        if rj.borrowed:
            a[2] += 1
        else:
            a[1] += rj.charge
    for key, acct in state._acct.items():
        if [acct.used, acct.gused, acct.borrowed_n] != acc.get(key, [0, 0, 0]):
            errs.append(f"{key}: accounting {acct.used, acct.gused, acct.borrowed_n} != {acc.get(key)}")
        if strict_quota and acct.gused > state.quota(*key).guaranteed:
            errs.append(f"{key}: guaranteed usage {acct.gused} > guarantee {state.quota(*key).guaranteed}")
    # reservations
    for nid, owners in state._node_res.items():
        for owner in owners:
            if owner not in state._reservations:
                errs.append(f"{nid}: reserved by unknown {owner}")
    res_held: dict[str, set[str]] = {}
    for res in state._reservations.values():
        for n in state.reservation_nodes(res):
            res_held.setdefault(n, set()).add(res.job_id)
    for n, owner_set in res_held.items():
        if set(state._node_res.get(n, ())) != owner_set:
            errs.append(f"{n}: reservation owners {state._node_res.get(n)} != {sorted(owner_set)}")
    free_by_owners: dict[str, dict[tuple[str, ...], int]] = {}
    for blk in state._blocks.values():
        for nid in blk.free_nodes:
            node_owners = state._node_res.get(nid)
            if node_owners:
                d = free_by_owners.setdefault(blk.id, {})
                d[node_owners] = d.get(node_owners, 0) + 1
    if free_by_owners != state._block_res_free:
        errs.append(f"free reserved nodes by owners wrong: {state._block_res_free} != {free_by_owners}")
    return errs


def _shape_errors(
    state: ClusterState,
    jid: str,
    spec,
    node_ids: list[str],
    held: dict[str, tuple[int, ...]],
    respect_topology: bool,
    placed_at: float,
) -> list[str]:
    """``placed_at``: when the job was placed (its max_blocks may have lapsed by then)."""
    errs = []
    ti = state._types.get(spec.gpu_type)
    if ti is None:
        return [f"{jid}: unknown type"]
    shape = job_shape(spec, ti.node_gpus)
    if isinstance(shape, str):
        return [f"{jid}: invalid shape placed: {shape}"]
    blocks = {state._nodes[n].block for n in node_ids}
    if shape.whole:
        if len(node_ids) != shape.nodes:
            errs.append(f"{jid}: {len(node_ids)} nodes, needs {shape.nodes}")
        for n in node_ids:
            if len(held[n]) != state._nodes[n].gpus:
                errs.append(f"{jid}: >= node-size job holds part of {n}")
    else:
        if sum(len(g) for g in held.values()) != shape.total:
            errs.append(f"{jid}: holds {sum(len(g) for g in held.values())} GPUs, needs {shape.total}")
    if spec.topology.pack is Pack.NODE and len(node_ids) > 1:
        errs.append(f"{jid}: pack=node on {len(node_ids)} nodes")
    limit = spec.topology.max_blocks_at(placed_at - spec.submit_time)
    if respect_topology and spec.topology.pack is Pack.BLOCK and limit and len(blocks) > limit:
        errs.append(f"{jid}: {len(blocks)} blocks > max_blocks {limit}")
    return errs


def _reserved_node_errors(
    state: ClusterState,
    after: dict[str, Reservation],
    now: float,
    job_id: str,
    spec,
    borrowed: bool,
    held: dict,
    policy: Policy,
    placed_guaranteed: dict[tuple[str, str], int],
) -> list[str]:
    """A placement on nodes another job's reservation held for the whole cycle (before the plan
    and after it, the same reservation) must be one the rules allow: never nodes cleared by
    preemption; on a head-of-line reservation's nodes only backfill ending by the expected
    start, a higher class (last resort; under ``guaranteed_reservations_hold`` not borrowed
    work on a gang that would run guaranteed), borrowed work that accepts eviction, or guaranteed
    work that waited past ``claim_borrowed_reservations_after_s`` on a borrowing gang's nodes.
    Whether the gang borrows is judged as the engine judged it, mid-cycle: counting the
    guaranteed GPUs the plan placed for the gang's team before this placement
    (``placed_guaranteed``; plan placements are in the engine's order)."""
    errs: list[str] = []
    mine = state._reservations.get(job_id)
    own_pre = set(mine.nodes) if mine is not None and mine.kind is ReservationKind.PREEMPTION else set()
    for nid in held:
        if nid in own_pre:
            continue  # cleared for it: its own whatever else picked the node (Search.own_pre)
        for owner in state._node_res.get(nid, ()):
            if owner == job_id:
                continue
            pre, post = state._reservations.get(owner), after.get(owner)
            if pre is None or post is None or post.created_at != pre.created_at or nid not in post.nodes:
                continue  # made, moved or dropped during the cycle: the engine judged another set
            if post.kind is ReservationKind.PREEMPTION:
                errs.append(f"{job_id}: uses {nid}, cleared by preemption for {owner}")
                continue
            # Policy.guaranteed_reservations_hold: borrowed work has no higher-class last resort
            # on a gang's nodes while that gang would run guaranteed
            class_rule = not (
                policy.guaranteed_reservations_hold
                and borrowed
                and not _owner_borrowed_then(state, post, placed_guaranteed)
            )
            if may_use(post, spec, now, policy, class_rule, evictably=borrowed):
                continue
            if (
                not borrowed
                and spec.waited(now, policy.claim_borrowed_reservations_after_s)
                and post.team != spec.team
                and _owner_borrowed_then(state, post, placed_guaranteed)
            ):
                continue
            errs.append(f"{job_id}: uses {nid}, reserved for {owner} from {post.expected_start:.0f}")
    return errs


def _owner_borrowed_then(state: ClusterState, res: Reservation, placed_guaranteed: dict[tuple[str, str], int]) -> bool:
    """``owner_borrows`` after the plan's earlier guaranteed placements for the owner's team."""
    if owner_borrows(state, res):
        return True
    used = state.guaranteed_used(res.team, res.gpu_type) + placed_guaranteed.get((res.team, res.gpu_type), 0)
    return used + res.gpus > state.quota(res.team, res.gpu_type).guaranteed


def _small_reclaim_due(job, now: float, policy: Policy, team_since: dict[tuple[str, str], float]) -> bool:
    """The engine's ``_small_reclaim_due``: waited ``reclaim_small_borrowed_after_s`` since its
    own submit or, with ``reclaim_wait_per_team``, since its team's oldest queued job's that
    fits the guarantee."""
    wait = policy.reclaim_small_borrowed_after_s
    if wait is None:
        return False
    if job.waited(now, wait):
        return True
    return policy.reclaim_wait_per_team and now - team_since.get((job.team, job.gpu_type), now) >= wait


def check_plan(
    state: ClusterState, plan: Plan, queue: JobQueue, policy: Policy, respect_topology: bool = True
) -> list[str]:
    """Check a plan against the state it was made from (before ``apply``)."""
    errs: list[str] = []
    now = plan.now
    nodes = state._nodes
    state.begin_tentative()
    try:
        for rl in plan.relabels:
            state.set_borrowed(rl.job_id, rl.borrowed)
        seen: dict[tuple[str, int], str] = {}
        gadd: dict[tuple[str, str], int] = {}
        badd: dict[tuple[str, str], int] = {}
        preempt_for: dict[str, list] = {}
        res_after = {r.job_id: r for r in plan.reservations}
        for pr in plan.preemptions:
            preempt_for.setdefault(pr.beneficiary, []).append(pr)
        for p in plan.placements:
            for gkey in p.gpu_keys():
                if gkey in seen:
                    errs.append(f"GPU {gkey} in two placements: {seen[gkey]} and {p.job_id}")
                seen[gkey] = p.job_id
            for ng in p.nodes:
                node = nodes.get(ng.node_id)
                if node is None:
                    errs.append(f"{p.job_id}: unknown node {ng.node_id}")
                    continue
                if node.health is not NodeHealth.READY:
                    errs.append(f"{p.job_id}: node {ng.node_id} is {node.health.value}")
                if node.gpu_type != p.gpu_type:
                    errs.append(f"{p.job_id}: node {ng.node_id} is {node.gpu_type}")
                m = mask_of(ng.gpus)
                if node.free_mask & m != m:
                    errs.append(f"{p.job_id}: GPUs {ng.gpus} of {ng.node_id} are not free")
                if (
                    node.spare_of is not None
                    and node.spare_of != p.job_id
                    and node.spare_of not in plan.dropped_spares
                    and ng.node_id not in plan.spares_taken
                ):
                    errs.append(f"{p.job_id}: uses {ng.node_id}, a spare of {node.spare_of}")
            for n in p.spare_nodes:
                node = nodes.get(n)
                if node is None or node.jobs or node.health is not NodeHealth.READY:
                    errs.append(f"{p.job_id}: spare {n} not a free ready node")
                if (n, 0) in seen:
                    errs.append(f"{p.job_id}: spare {n} also placed")
            if p.replacement:
                rj = state._running.get(p.job_id)
                if rj is None or rj.rank != SERVING_RANK:
                    errs.append(f"{p.job_id}: replacement for a job that is not running prod-serving")
                continue
            spec = queue.get(p.job_id)
            if spec is None:
                errs.append(f"{p.job_id}: placed but not queued")
                continue
            held = {ng.node_id: ng.gpus for ng in p.nodes}
            # gang all-or-nothing: every replica placed, on GPUs of the placement
            reps = sorted(s.replica for s in p.slots)
            if reps != list(range(spec.replicas)):
                errs.append(f"{p.job_id}: replicas {reps} != all {spec.replicas}")
            for s in p.slots:
                if len(s.gpus) != spec.gpus_per_replica or not set(s.gpus) <= set(held.get(s.node_id, ())):
                    errs.append(f"{p.job_id}: replica {s.replica} slot wrong")
            # Policy.spread_before_preempt: a job run guaranteed may take free nodes beyond a soft block limit
            spread_ok = (
                policy.spread_before_preempt
                and not p.borrowed
                and spec.rank != SERVING_RANK
                and spec.topology.max_blocks_wait_s is not None
            )
            placed_at = math.inf if spread_ok else now
            errs.extend(_shape_errors(state, p.job_id, spec, sorted(held), held, respect_topology, placed_at))
            errs.extend(_reserved_node_errors(state, res_after, now, p.job_id, spec, p.borrowed, held, policy, gadd))
            key = (spec.team, spec.gpu_type)
            if p.borrowed:
                badd[key] = badd.get(key, 0) + p.gpus
                # (Policy.serving_idle_guard lets it take idle GPUs the forecast leaves spare:
                # a judgement of the cycle's forecast, not checked here)
                if spec.rank == SERVING_RANK and not policy.serving_borrows_idle and policy.serving_idle_guard is None:
                    res = state._reservations.get(p.job_id)
                    if res is None or res.kind is not ReservationKind.PREEMPTION or not set(held) <= set(res.nodes):
                        errs.append(f"{p.job_id}: prod-serving beyond its guarantee placed on idle capacity")
            else:
                gadd[key] = gadd.get(key, 0) + p.gpus
        for key in set(gadd) | set(badd):
            q = state.quota(*key)
            g = state.guaranteed_used(*key) + gadd.get(key, 0)
            if gadd.get(key, 0) and g > q.guaranteed:
                errs.append(f"{key}: guaranteed usage {g} > guarantee {q.guaranteed}")
            b = state.borrowed_used(*key) + badd.get(key, 0)
            if badd.get(key, 0) and b > q.borrow_limit:
                errs.append(f"{key}: borrowed usage {b} > borrow limit {q.borrow_limit}")
        # victims
        victims_seen: set[str] = set()
        # oldest queued submit within the guarantee per (team, type), as the engine reads it
        team_since = quota_mod.within_guarantee_since(state, queue) if policy.reclaim_wait_per_team else {}
        for pr in plan.preemptions:
            if pr.victim in victims_seen:
                errs.append(f"{pr.victim}: preempted twice")
            victims_seen.add(pr.victim)
            rj = state._running.get(pr.victim)
            ben = queue.get(pr.beneficiary)
            if rj is None or ben is None:
                errs.append(f"preemption {pr}: unknown victim or beneficiary")
                continue
            if rj.rank == SERVING_RANK:
                errs.append(f"{pr.victim}: prod-serving chosen as a victim")
            if rj.preempting_for is not None:
                errs.append(f"{pr.victim}: already being preempted")
            if (
                rj.spec.start_protected(
                    rj.borrowed,
                    policy.first_runs_unprotected_min_gpus is not None
                    and ben.total_gpus >= policy.first_runs_unprotected_min_gpus,
                )
                and now - rj.started_at < policy.preemption_protect_s
            ):
                errs.append(f"{pr.victim}: guaranteed, preempted {now - rj.started_at:.0f}s after its start")
            if (
                not rj.borrowed
                and policy.daily_preemption_budget >= 0  # negative: no budget, as victims.eligible reads it
                and rj.spec.preemptions_since(now - policy.preemption_window_s) >= policy.daily_preemption_budget
            ):
                errs.append(f"{pr.victim}: past its daily preemption budget and not borrowed")
            ti = state._types[ben.gpu_type]
            shape = job_shape(ben, ti.node_gpus)
            charge = shape.charge if not isinstance(shape, str) else 0
            ben_borrowed = quota_mod.classify(state, ben, charge, policy)
            ben_res = state._reservations.get(pr.beneficiary)
            evicted = evictable_for(rj, ben_res)
            if evicted:
                # backfill on the beneficiary's reserved nodes, stopped when it is ready; borrowed
                # work there before the reservation only for an owner within its guarantee
                if ben_borrowed and ben_res is not None and rj.started_at < ben_res.created_at:
                    errs.append(f"{pr.beneficiary}: borrows yet reclaims {pr.victim}, there before its reservation")
            elif ben_borrowed:
                if ben.rank != SERVING_RANK and not (
                    policy.borrowed_gangs_reclaim_lower and rj.borrowed and rj.rank > ben.rank
                ):
                    errs.append(f"{pr.beneficiary}: borrows yet preempts {pr.victim}")
                elif not rj.borrowed:
                    errs.append(f"{pr.beneficiary}: prod-serving beyond guarantee takes non-borrowed {pr.victim}")
            higher_small = (
                _small_reclaim_due(ben, now, policy, team_since)
                and not ben_borrowed
                and rj.rank != SERVING_RANK
                and (
                    rj.charge < policy.reserve_min_gpus
                    or (
                        policy.reclaim_higher_borrowed_gangs
                        and not isinstance(shape, str)
                        and shape.whole
                        and shape.charge >= policy.reserve_min_gpus
                        and rj.charge <= shape.charge
                        and (
                            not ben.preemption_times
                            or now - ben.preemption_times[-1] >= (policy.reclaim_small_borrowed_after_s or 0.0)
                        )
                    )
                )
            )
            if not (rj.rank > ben.rank or (rj.borrowed and (rj.rank == ben.rank or higher_small))):
                errs.append(
                    f"{pr.victim} (rank {rj.rank}) is not lower class or same-class borrowed for {pr.beneficiary}"
                )
            if rj.team == ben.team and (rj.rank <= ben.rank or ben_borrowed) and not evicted:
                errs.append(f"{pr.beneficiary}: reclaims its own team's borrowed {pr.victim}")
            if rj.gpu_type != ben.gpu_type:
                errs.append(f"{pr.victim}: other GPU type than {pr.beneficiary}")
        # reasons
        placed = {p.job_id for p in plan.placements}
        pend = {p.job_id for p in plan.pending}
        if placed & pend:
            errs.append(f"placed and pending: {sorted(placed & pend)}")
        if len(placed - {p.job_id for p in plan.placements if p.replacement}) + len(pend) != plan.considered:
            errs.append("considered jobs without a reason")
    finally:
        state.rollback()
    return errs
