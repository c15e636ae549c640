"""The cluster map on the running stack: leader, real agents, the API on uvicorn. A user signs
in through the form, the grid shows every GPU of the fleet, and jobs the leader places appear
on it as the page polls (docs/design.md, Observability)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import PY
from tests.ui.test_cluster_map_browser import CHROMIUM, CHROMIUM_ARGS, artifact_dir, cell_states

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM} (.ci/run installs it)"),
]


async def test_the_map_follows_the_leaders_placements(stack, tmp_path):
    from playwright.async_api import async_playwright, expect

    from api.main import create_app
    from tests.api.test_cli import UvicornThread

    sleep = [PY, "-c", "import time; time.sleep(120)"]
    first = await stack.submit(command=sleep, gpus_per_replica=2)
    await stack.wait_state(first, "RUNNING")
    with UvicornThread(create_app(stack.settings)) as server:
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            try:
                page = await browser.new_page(viewport={"width": 1200, "height": 800})
                await page.goto(server.url + "/ui/")
                await page.fill("#token", "tok-alpha")
                await page.click("#login-button")
                await expect(page.locator("#principal")).to_contain_text("alice")
                await page.wait_for_function("document.querySelectorAll('#grid .gpu[data-state]').length === 32")
                states = await cell_states(page)
                assert states["guaranteed"] == 2 and states["free"] == 30, states

                second = await stack.submit(command=sleep, gpus_per_replica=4)
                await stack.wait_state(second, "RUNNING")
                await page.wait_for_function(
                    "document.querySelectorAll('#grid .gpu[data-state=\"guaranteed\"]').length === 6", timeout=15_000
                )
                await expect(page.locator("#idle-gpus")).to_have_text("26")
                shot = artifact_dir(tmp_path) / "cluster-map-on-stack.png"
                await page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 10_000
            finally:
                await browser.close()
