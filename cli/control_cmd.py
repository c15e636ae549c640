"""`gpufleet control`: run one control process from settings until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import typer


def serve(
    holder: str = typer.Option(None, help="leader holder name (default: host-pid-random)"),
    grpc: bool = typer.Option(True, "--grpc/--no-grpc", help="serve the agents' gRPC stream"),
    log_level: str = typer.Option("INFO", help="logging level"),
    job_worker: bool = typer.Option(
        False, "--job-worker", help="serve only the job workflows' task queue (a child of a control process)"
    ),
) -> None:
    """Run a control process: Temporal workers, leadership, placement, heartbeat gRPC."""
    from common.embedded import PlatformError
    from common.settings import Settings
    from common.temporal import hard_exit

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings()
    if job_worker:
        from control.job_workers import settings_for_child

        settings = settings_for_child() or settings
    code = 0
    try:
        from common.secrets import require_production_ready

        if not settings.database_url:
            raise PlatformError("GPUFLEET_DATABASE_URL is not set (`gpufleet up` sets it for its children)")
        require_production_ready(settings, "job-worker" if job_worker else "control")
        asyncio.run(_jobs_main(settings) if job_worker else _main(settings, holder, grpc))
    except PlatformError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 0
    except Exception as e:  # one line, no traceback, for the operator
        print(f"error: control stopped: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    hard_exit(code)


async def _main(settings, holder: str | None, grpc: bool) -> None:
    from control.process import run_control

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await run_control(settings, holder=holder, stop_event=stop, grpc=grpc)


async def _jobs_main(settings) -> None:
    from control.job_workers import serve_job_worker

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve_job_worker(settings, stop)
