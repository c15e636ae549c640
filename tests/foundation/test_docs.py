"""The README keeps the two set-up commands and points only inside the repo; docs/design.md
is the one design and its generated tables match the code."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from cli.design_doc import DESIGN, TABLES, render, stale
from common.settings import Settings
from placement import Policy

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


def test_every_policy_field_is_in_the_placement_readme_with_its_default():
    """placement/README.md lists every Policy knob as ``name=default`` (or, for a few, by name
    with the values spelled out), so a new field or a changed default shows there too."""
    text = (ROOT / "placement" / "README.md").read_text()
    spelled_out = {"ordering", "topology", "reservations", "backfill", "preemption", "borrowing"}
    wrong = []
    for f in dataclasses.fields(Policy):
        if f.name in spelled_out:
            ok = f"`{f.name}`" in text
        else:
            value = f.default
            shown = "None" if value is None else (f"{value:g}" if isinstance(value, float) else str(value))
            ok = f"`{f.name}={shown}`" in text
        if not ok:
            wrong.append(f"{f.name}={f.default}")
    assert not wrong, f"placement/README.md misses or misstates: {wrong}"


def test_a_stale_table_is_caught_and_rewritten():
    text = DESIGN.read_text().replace("| `QUEUED` | `allocate` | `STARTING` |", "| `QUEUED` | `allocate` | `RUNNING` |")
    assert stale(text) == ["job-states"]
    assert stale(render(text)) == []
    assert set(TABLES) == {"settings", "job-states", "node-states", "migrations"}


def test_the_design_doc_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)[^)]*\)", DESIGN.read_text()):
        if "://" not in target:
            assert (DESIGN.parent / target).resolve().exists(), target
