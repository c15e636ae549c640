"""`gpufleet up` as a user runs it: the banner names the cluster map and one /metrics URL per
process, and each answers (docs/design.md, Observability)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from common.embedded import any_free_port

pytestmark = pytest.mark.e2e


def test_up_prints_the_ui_and_every_process_metrics_url_and_each_answers(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env.update(
        GPUFLEET_STATE_DIR=str(tmp_path / "state"),
        GPUFLEET_API_PORT=str(any_free_port()),
        GPUFLEET_CONTROL_GRPC_PORT=str(any_free_port()),
        GPUFLEET_CONTROL_ADDRESSES=f'["127.0.0.1:{any_free_port()}"]',
        GPUFLEET_CONTROL_METRICS_LISTEN=f"127.0.0.1:{any_free_port()}",
        GPUFLEET_TEMPORAL_PORT=str(any_free_port()),
        GPUFLEET_TEMPORAL_UI_PORT=str(any_free_port()),
        GPUFLEET_AGENT_SIMULATE="2",
        GPUFLEET_AGENT_RANK_ISOLATION="false",
    )
    out_path = tmp_path / "up.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "up"], env=env, stdout=out, stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[2], start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        text = ""
        while "Ctrl-C" not in text:
            assert proc.poll() is None, f"gpufleet up exited {proc.returncode}: {out_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no banner in 180 s: {text[-3000:]}"
            time.sleep(0.5)
            text = out_path.read_text()
        ui = re.search(r"^\s+ui\s+(http://\S+/ui)$", text, re.M)
        assert ui, text
        metrics = dict(re.findall(r"^\s+metrics\s+(\w+)\s+(http://\S+/metrics)$", text, re.M))
        assert set(metrics) == {"api", "control", "agent"}, text
        with httpx.Client(timeout=5, follow_redirects=True) as http:
            assert "cluster map" in http.get(ui.group(1)).text
            want = {"api": "gpufleet_api_requests_total", "control": "gpufleet_control_is_leader",
                    "agent": "gpufleet_gpu_utilization_percent"}  # fmt: skip
            for name, url in metrics.items():
                deadline = time.monotonic() + 60  # the control and the agent start after the banner's API
                while True:
                    try:
                        r = http.get(url)
                        if r.status_code == 200 and want[name] in r.text:
                            break
                    except httpx.HTTPError:
                        pass
                    assert time.monotonic() < deadline, f"{name} {url} never served {want[name]}"
                    time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
