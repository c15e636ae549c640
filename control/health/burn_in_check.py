"""The burn-in test a node runs before it returns to service (docs/design.md, Health).

Run by the node agent as a rank on every GPU of the node (``CUDA_VISIBLE_DEVICES``):

* real GPUs (torch with CUDA): a matmul stress test on each GPU (results checked against
  a float64 reference), then an NCCL all-reduce across the node's GPUs (the sum checked);
* simulated nodes (no NVIDIA device, or ``GPUFLEET_BURN_IN_MODE=simulated``): compute on
  the CPU for the test's duration — the simulated backend shows a GPU as busy as its rank's
  process is (worker_agent.nvml), unless a fault (hang) keeps it idle, and the leader fails
  a burn-in whose GPUs were never busy.

Exit 0: passed. Standalone (no gpufleet imports): the agent runs it by path.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _simulated(seconds: float) -> int:
    # busy, not asleep: the simulated GPUs read the CPU use of the rank that holds them
    deadline = time.monotonic() + seconds
    x = 0
    while time.monotonic() < deadline:
        for i in range(10_000):
            x = (x * 31 + i) % 1_000_003
    print(f"burn-in (simulated): loaded the GPUs for {seconds:.1f}s", flush=True)
    return 0


def _allreduce_worker(rank: int, world: int, port: int, q) -> None:  # pragma: no cover - needs GPUs
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    x = torch.full((1 << 24,), float(rank + 1), device="cuda")
    for _ in range(10):
        y = x.clone()
        dist.all_reduce(y)
    torch.cuda.synchronize()
    ok = bool(torch.allclose(y, torch.full_like(y, world * (world + 1) / 2)))
    q.put((rank, ok))
    dist.destroy_process_group()


def _real(seconds: float) -> int:  # pragma: no cover - needs GPUs
    import torch
    import torch.multiprocessing as mp

    n = torch.cuda.device_count()
    if n == 0:
        print("burn-in: no CUDA device visible", file=sys.stderr)
        return 2
    a64 = torch.randn(2048, 2048, dtype=torch.float64)
    ref = a64 @ a64
    per_gpu = max(1.0, seconds / 2 / n)
    for i in range(n):
        dev = torch.device("cuda", i)
        a = a64.to(dev, torch.float32)
        deadline = time.monotonic() + per_gpu
        while time.monotonic() < deadline:
            c = a @ a
        torch.cuda.synchronize(dev)
        err = (c.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
        if not err < 1e-3:
            print(f"burn-in: GPU {i} matmul error {err:.2e}", file=sys.stderr)
            return 1
        print(f"burn-in: GPU {i} matmul ok (rel err {err:.1e})", flush=True)
    if n > 1:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = 29400 + os.getpid() % 1000
        procs = [ctx.Process(target=_allreduce_worker, args=(r, n, port, q)) for r in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=max(120.0, seconds))
        results = dict(q.get_nowait() for _ in range(q.qsize())) if not q.empty() else {}
        if len(results) != n or not all(results.values()) or any(p.exitcode != 0 for p in procs):
            print(f"burn-in: NCCL all-reduce failed: {results}", file=sys.stderr)
            return 1
        print(f"burn-in: NCCL all-reduce over {n} GPUs ok", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args(argv)
    mode = os.environ.get("GPUFLEET_BURN_IN_MODE", "")
    if mode != "simulated" and (mode == "real" or os.path.exists("/dev/nvidia0")):
        try:
            return _real(args.seconds)
        except ImportError as e:
            print(f"burn-in: cannot run on real GPUs: {e}", file=sys.stderr)
            return 2
    return _simulated(args.seconds)


if __name__ == "__main__":
    sys.exit(main())
