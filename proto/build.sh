#!/usr/bin/env bash
# Regenerate proto/agent_pb2.py, agent_pb2.pyi and agent_pb2_grpc.py from proto/agent.proto.
# Run from anywhere; needs grpcio-tools (in the `dev`/`test` extras).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
[ -x "$py" ] || py=python3
cd "$root"
# -I "$root" with the path proto/agent.proto makes the generated code import
# `from proto import agent_pb2`, so it works as the `proto` package.
"$py" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. proto/agent.proto
echo "generated proto/agent_pb2.py proto/agent_pb2.pyi proto/agent_pb2_grpc.py"
