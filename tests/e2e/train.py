"""A small deterministic "training" job for the lifecycle tests (standard library only).

    python train.py STEPS STEP_SECONDS [CKPT_EVERY]

State is (step, value); each step updates value by a fixed recurrence, so the final
value depends only on STEPS. A checkpoint is a step directory (one file per rank), so
every rank of a gang reports the same URI for it, as ``worker_agent.jobhelper`` does. On SIGTERM it checkpoints and exits 143. With
GPUFLEET_RESUME_FROM it continues from that checkpoint. Every checkpoint is
published to GPUFLEET_PROGRESS_FILE (``step``, ``checkpoint_uri``, ``checkpoint_step``)
as the agent's supervisor expects; the result goes to
GPUFLEET_CHECKPOINT_DIR/result-<rank>.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


def step_value(value: int, step: int) -> int:
    return (value * 1103515245 + 12345 + step) % 2**31


def expected(steps: int) -> int:
    value = 1
    for s in range(steps):
        value = step_value(value, s)
    return value


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    step_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
    every = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    rank = os.environ.get("RANK", "0")
    ck_dir = Path(os.environ.get("GPUFLEET_CHECKPOINT_DIR") or ".")
    ck_dir.mkdir(parents=True, exist_ok=True)
    progress = os.environ.get("GPUFLEET_PROGRESS_FILE")
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))

    step, value, resumed_from = 0, 1, None
    resume = os.environ.get("GPUFLEET_RESUME_FROM")
    if resume:
        path = resume[len("file://") :] if resume.startswith("file://") else resume
        state = json.loads((Path(path) / f"rank-{rank}.json").read_text())
        step, value, resumed_from = state["step"], state["value"], resume

    def checkpoint() -> str:
        step_dir = ck_dir / f"step-{step:08d}"
        step_dir.mkdir(parents=True, exist_ok=True)
        _write_json(step_dir / f"rank-{rank}.json", {"step": step, "value": value})
        uri = "file://" + str(step_dir)
        if progress:
            Path(progress).parent.mkdir(parents=True, exist_ok=True)
            _write_json(Path(progress), {"step": step, "checkpoint_uri": uri, "checkpoint_step": step})
        return uri

    while step < steps:
        if stop["flag"]:
            checkpoint()
            return 143
        value = step_value(value, step)
        step += 1
        if every and step % every == 0:
            checkpoint()
        if progress and not every:
            pass
        time.sleep(step_s)
    _write_json(
        ck_dir / f"result-{rank}.json",
        {"value": value, "steps": steps, "attempt": os.environ.get("GPUFLEET_ATTEMPT"), "resumed_from": resumed_from},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
