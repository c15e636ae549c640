"""A training loop that survives preemption (plain python3: no GPU, no torch needed).

Each rank gets a torchrun-style env: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
and GPUFLEET_CHECKPOINT_DIR (write checkpoints here), GPUFLEET_RESUME_FROM (set on a later
attempt: the checkpoint to resume from), GPUFLEET_PROGRESS_FILE (report each checkpoint here).
Preempted, it gets SIGTERM: it checkpoints and exits 143 within the grace period.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

STEPS = int(os.environ.get("STEPS", "40"))
STEP_SECONDS = float(os.environ.get("STEP_SECONDS", "0.25"))
EVERY = int(os.environ.get("CHECKPOINT_EVERY", "8"))
rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
local_rank = os.environ.get("LOCAL_RANK", "0")
master = f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ.get('MASTER_PORT', '29500')}"
ckpt_dir = Path(os.environ.get("GPUFLEET_CHECKPOINT_DIR") or "checkpoints").absolute()
progress = os.environ.get("GPUFLEET_PROGRESS_FILE")
print(f"rank {rank}/{world} local_rank {local_rank} master {master} checkpoints {ckpt_dir}", flush=True)

stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))


def path_of(uri: str) -> Path:
    return Path(uri[len("file://") :] if uri.startswith("file://") else uri)


def checkpoint(step: int, loss: float) -> None:
    step_dir = ckpt_dir / f"step-{step:08d}"  # one directory per step, one file per rank
    step_dir.mkdir(parents=True, exist_ok=True)
    tmp = step_dir / f".rank-{rank}.tmp"
    tmp.write_text(json.dumps({"step": step, "loss": loss}))
    os.replace(tmp, step_dir / f"rank-{rank}.json")
    if progress:  # tell the platform: the next attempt resumes from here
        report = {"step": step, "checkpoint_uri": step_dir.as_uri(), "checkpoint_step": step}
        Path(progress).write_text(json.dumps(report))
    print(f"checkpoint step {step} -> {step_dir.as_uri()}", flush=True)


step, loss = 0, 10.0
resume = os.environ.get("GPUFLEET_RESUME_FROM")
if resume:
    state = json.loads((path_of(resume) / f"rank-{rank}.json").read_text())
    step, loss = state["step"], state["loss"]
    print(f"resumed from step {step} ({resume})", flush=True)

while step < STEPS:
    time.sleep(STEP_SECONDS)  # one step of "training"
    step, loss = step + 1, loss * 0.95
    if stopping:
        print(f"SIGTERM at step {step}: checkpointing, then exiting", flush=True)
        checkpoint(step, loss)
        sys.exit(143)
    if step % EVERY == 0:
        checkpoint(step, loss)
print(f"done: {STEPS} steps, loss {loss:.4f}", flush=True)
