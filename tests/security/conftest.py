"""The security tests run on the e2e stack (one control process with its gRPC server, real
agents for every node, the API in-process)."""

from tests.e2e.conftest import stack, stack_overrides  # noqa: F401
