"""README.md keeps the two set-up commands and documents every setting."""

from __future__ import annotations

from pathlib import Path

from common.settings import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_two_setup_commands():
    assert "make up" in README and "make test" in README


def test_every_setting_is_in_the_settings_table():
    missing = [f"GPUFLEET_{n.upper()}" for n in Settings.model_fields if f"`GPUFLEET_{n.upper()}`" not in README]
    assert not missing, f"regenerate the README table with `gpufleet settings --markdown`: {missing}"
