"""Recording reuses the workflow tests' stand (a control worker and a fake agent)."""

from tests.workflows.conftest import settings_overrides, stand  # noqa: F401
