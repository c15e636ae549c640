"""Who an agent is on the wire: per-node credentials and the metadata that carries them.

Both ends use these helpers, so the agent and the control plane agree on the
derivation without sharing anything but settings:

* ``settings.agent_credentials[node_id]`` when set (production: provisioned per node);
* otherwise HMAC-SHA256(``agent_shared_secret``, node id) (dev and the simulated fleet);
  an empty ``agent_shared_secret`` disables the derivation, so only provisioned
  nodes can connect.

Rank processes never see any of these (worker_agent.runtime strips them).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

NODE_ID_KEY = "x-gpufleet-node-id"
CREDENTIAL_KEY = "x-gpufleet-credential"
AUTHORIZATION_KEY = "authorization"


def node_credential(settings, node_id: str) -> str | None:
    """The credential node ``node_id`` presents, or None when it has none."""
    provisioned = settings.agent_credentials.get(node_id)
    if provisioned:
        return provisioned
    secret = settings.agent_shared_secret
    if not secret:
        return None
    return hmac.new(secret.encode(), b"gpufleet-node:" + node_id.encode(), hashlib.sha256).hexdigest()


def node_metadata(node_id: str, credential: str) -> tuple[tuple[str, str], ...]:
    return ((NODE_ID_KEY, node_id), (CREDENTIAL_KEY, credential))


def metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v.decode() if isinstance(v, bytes) else v
    return None


def check_credential(expected: str | None, presented: str | None) -> bool:
    """Constant-time comparison; a node without an expected credential never passes."""
    if not expected or not presented:
        return False
    return hmac.compare_digest(expected.encode(), presented.encode())


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTHORIZATION_KEY, f"Bearer {token}"),)
