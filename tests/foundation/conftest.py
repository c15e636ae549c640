"""Fixtures for tests that run `gpufleet up` as a subprocess."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def state_root() -> Iterator[Path]:
    """A directory for a platform's state dir, outside pytest's tmp_path.

    As root, the embedded Postgres runs as the unprivileged `pgserver` user and
    opens the prefix folders for traversal; pytest resets its own
    `/tmp/pytest-of-root` to 0700 whenever another pytest session starts, which
    would lock that user out mid-run.
    """
    root = Path(tempfile.mkdtemp(prefix="gpufleet-stack-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)
