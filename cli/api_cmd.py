"""`gpufleet api`: serve the public REST API with uvicorn."""

from __future__ import annotations

import sys
from typing import Annotated

import typer


def serve(
    host: Annotated[str | None, typer.Option(help="bind address (default: GPUFLEET_API_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default: GPUFLEET_API_PORT)")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
) -> None:
    """Run the REST API (uvicorn) on settings.api_host:api_port with create_app()."""
    import uvicorn

    from api.main import create_app
    from common.embedded import PlatformError
    from common.secrets import require_production_ready
    from common.settings import Settings
    from common.temporal import hard_exit

    settings = Settings()
    try:
        require_production_ready(settings, "api")
    except PlatformError as e:
        print(f"error: {e}", file=sys.stderr)
        hard_exit(2)
    app = create_app(settings)
    code = 0
    try:
        uvicorn.run(
            app,
            host=host or settings.api_host,
            port=port or settings.api_port,
            log_level=log_level,
            proxy_headers=False,
            server_header=False,
        )
    except SystemExit as e:  # uvicorn exits(1) when startup fails
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    # docs/design.md, Known pitfalls: a process that used temporalio can crash at interpreter exit
    hard_exit(code)
