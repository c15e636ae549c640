"""Recording reuses the workflow tests' stands (control worker + fake agent, or control processes)."""

from tests.workflows.conftest import settings_overrides, stand  # noqa: F401
from tests.workflows.test_placement_control import cluster  # noqa: F401
