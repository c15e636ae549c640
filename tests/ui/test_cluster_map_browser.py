"""The cluster map page (/ui) in headless Chromium against a real running API over Postgres:
a bad token is refused with a message, a good one signs in through the form, every GPU gets a
cell coloured by its state, the page polls (a node's change shows up), a token refused later
returns to the login. Saves a screenshot ($GPUFLEET_ARTIFACTS, else the test's tmp dir; also
/work/notes/ui-screenshot.png when that directory exists).

Uses Debian's /usr/bin/chromium (`apt-get install chromium`; .ci/run installs it), never a
browser download; skipped only when it is absent."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.api.cluster_seed import EXPECTED_GPUS
from tests.api.conftest import ALPHA

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
NOTES_SCREENSHOT = Path("/work/notes/ui-screenshot.png")

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does)"
)


def artifact_dir(tmp_path: Path) -> Path:
    root = os.environ.get("GPUFLEET_ARTIFACTS")
    out = Path(root) if root else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    return out


async def cell_states(page) -> Counter:
    return Counter(await page.eval_on_selector_all("#grid .gpu[data-state]", "cs => cs.map(c => c.dataset.state)"))


async def test_cluster_map_in_headless_chromium(server, pool, tmp_path):
    from playwright.async_api import async_playwright, expect

    sent_auth: list[str | None] = []
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on(
                "request",
                lambda r: sent_auth.append(r.headers.get("authorization")) if "/v1/cluster" in r.url else None,
            )
            await page.goto(server.url + "/ui/")
            await expect(page.locator("#login-form")).to_be_visible()
            await expect(page.locator("#app")).to_be_hidden()

            # a bad token: a clear message, still on the login
            await page.fill("#token", "not-a-token")
            await page.click("#login-button")
            await expect(page.locator("#login-error")).to_be_visible()
            await expect(page.locator("#login-error")).to_contain_text("not recognised")
            await expect(page.locator("#login-form")).to_be_visible()

            # team alpha signs in through the form; the grid fills with a cell per GPU
            await page.fill("#token", ALPHA)
            await page.click("#login-button")
            await expect(page.locator("#principal")).to_contain_text("alice")
            await page.wait_for_function("document.querySelectorAll('#grid .gpu[data-state]').length === 72")
            assert await cell_states(page) == Counter(EXPECTED_GPUS)
            assert await page.evaluate("sessionStorage.getItem('gpufleet.token')") == ALPHA
            assert sent_auth and all(a == f"Bearer {ALPHA}" for a in sent_auth)

            # hover text: owner team, and the job only for alpha's own
            borrowed = page.locator('[data-node="b0-n0"] .gpu[data-index="4"]')
            assert await borrowed.get_attribute("title") == "b0-n0 GPU 4: borrowed - team alpha, job a-borrow"
            beta_gpu = page.locator('[data-node="b0-n1"] .gpu[data-index="0"]')
            assert await beta_gpu.get_attribute("title") == "b0-n1 GPU 0: guaranteed - team beta"
            # legend, queue, teams, idle cost
            assert await page.locator("#legend li").count() == 8
            await expect(page.locator("#idle-gpus")).to_have_text("26")
            await expect(page.locator("#idle-cost")).to_contain_text("$")
            await expect(page.locator('#queue table[data-class="prod-batch"]')).to_contain_text("a-big")
            await expect(page.locator('#queue table[data-class="prod-batch"]')).to_contain_text("reserved")
            await expect(page.locator('#queue table[data-class="research"]')).to_contain_text("(another team's job)")
            await expect(page.locator("#teams tbody tr")).to_have_count(2)
            await expect(page.locator("#idle-teams")).to_contain_text("beta")

            shot = artifact_dir(tmp_path) / "ui-screenshot.png"
            await page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if NOTES_SCREENSHOT.parent.is_dir():
                shutil.copyfile(shot, NOTES_SCREENSHOT)

            # it polls: a node back in service shows up without a reload
            await pool.execute("UPDATE nodes SET state = 'ready', reason = NULL WHERE node_id = 'b0-n2'")
            await page.wait_for_function(
                "[...document.querySelectorAll('[data-node=\"b0-n2\"] .gpu')].every(c => c.dataset.state === 'free')",
                timeout=10_000,
            )

            # a token refused later (revoked, rotated): back to the login, with the reason
            await page.evaluate("sessionStorage.setItem('gpufleet.token', 'revoked-token')")
            await expect(page.locator("#login-form")).to_be_visible(timeout=10_000)
            await expect(page.locator("#login-error")).to_contain_text("Sign-in failed")
            assert await page.evaluate("sessionStorage.getItem('gpufleet.token')") is None
        finally:
            await browser.close()
