"""The README keeps the two set-up commands and points only inside the repo; docs/design.md
is the one design and its generated tables match the code."""

from __future__ import annotations

import re
from pathlib import Path

from cli.design_doc import DESIGN, TABLES, render, stale
from common.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_two_setup_commands():
    assert "make up" in README and "make test" in README


def test_the_readme_points_only_inside_the_repo_and_at_the_design():
    assert "../shared" not in README and "DESIGN.md" not in README
    assert "docs/design.md" in README
    for target in re.findall(r"\]\(([^)#]+)[^)]*\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links {target}, which the repo does not have"


def test_the_design_doc_tables_are_current():
    names = stale(DESIGN.read_text())
    assert not names, f"docs/design.md is stale: {names}; run `gpufleet docs`"


def test_every_setting_is_in_the_design_doc():
    text = DESIGN.read_text()
    missing = [f"GPUFLEET_{n.upper()}" for n in Settings.model_fields if f"`GPUFLEET_{n.upper()}`" not in text]
    assert not missing, missing


def test_a_stale_table_is_caught_and_rewritten():
    text = DESIGN.read_text().replace("| `QUEUED` | `allocate` | `STARTING` |", "| `QUEUED` | `allocate` | `RUNNING` |")
    assert stale(text) == ["job-states"]
    assert stale(render(text)) == []
    assert set(TABLES) == {"settings", "job-states", "node-states", "migrations"}


def test_the_design_doc_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)[^)]*\)", DESIGN.read_text()):
        if "://" not in target:
            assert (DESIGN.parent / target).resolve().exists(), target
