"""The tables of docs/design.md that are generated from the code, and the check that they
are current: the settings, the job states (``placement.lifecycle.EDGES``), the node
states (``control.health.node_states.TABLE``) and the migrations.

Each table sits between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->``;
``gpufleet docs`` rewrites them, ``gpufleet docs --check`` (and a test) fails when one is
stale.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def settings_table() -> str:
    from common.settings import Settings

    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for name, f in Settings.model_fields.items():
        default = f.default_factory() if f.default_factory else f.default  # type: ignore[call-arg]
        shown = json.dumps(default, default=str)
        if isinstance(default, dict) and len(shown) > 60:
            shown = '"{...}"'
        lines.append(f"| `GPUFLEET_{name.upper()}` | `{shown}` | {f.description or ''} |")
    return "\n".join(lines)


def job_states_table() -> str:
    from placement.lifecycle import EDGES, TERMINAL, JobState

    lines = ["| state | event | next state | why |", "|---|---|---|---|"]
    for (state, event), (to, why) in EDGES.items():
        lines.append(f"| `{state.value}` | `{event.value}` | `{to.value}` | {why} |")
    terminal = ", ".join(f"`{s.value}`" for s in JobState if s in TERMINAL)
    lines.append("")
    lines.append(f"Terminal states: {terminal}. Any (state, event) pair not listed is refused.")
    return "\n".join(lines)


def node_states_table() -> str:
    from control.health.node_states import TABLE

    lines = ["| state | event | next state | actions | why |", "|---|---|---|---|---|"]
    for (state, event), t in TABLE.items():
        if t.to == state and not t.actions:
            continue  # a "stay" edge: listed in the code, left out here
        actions = ", ".join(a.value for a in t.actions) or "-"
        lines.append(f"| `{state.value}` | `{event.value}` | `{t.to.value}` | {actions} | {t.why} |")
    return "\n".join(lines)


def migrations_table() -> str:
    """Each migration with the first sentence of its leading comment (migrations never change,
    so their references to the retired shared DESIGN.md are left out here)."""
    from common.db import migration_files

    lines = ["| migration | what it does |", "|---|---|"]
    for name, sql in migration_files():
        head = []
        for ln in sql.splitlines():
            if not ln.startswith("--"):
                break
            head.append(ln[2:].strip())
        text = re.sub(r"\s*\(DESIGN\.md[^)]*\)", "", " ".join(head))
        first = re.split(r"(?<=\.)\s", text, maxsplit=1)[0]
        lines.append(f"| `{name}` | {first} |")
    return "\n".join(lines)


TABLES: dict[str, Callable[[], str]] = {
    "settings": settings_table,
    "job-states": job_states_table,
    "node-states": node_states_table,
    "migrations": migrations_table,
}


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated:{name} -->\n)(.*?)(<!-- /generated:{name} -->)", re.S)


def render(text: str) -> str:
    """``text`` with every generated table replaced by its current value."""
    for name, make in TABLES.items():
        pattern = _pattern(name)
        if not pattern.search(text):
            raise ValueError(f"docs/design.md has no <!-- generated:{name} --> block")
        body = make() + "\n"
        match = pattern.search(text)
        assert match is not None
        text = text[: match.start(2)] + body + text[match.end(2) :]
    return text


def stale(text: str) -> list[str]:
    """The names of the tables in ``text`` that differ from the code."""
    out = []
    for name, make in TABLES.items():
        m = _pattern(name).search(text)
        if m is None or m.group(2) != make() + "\n":
            out.append(name)
    return out
