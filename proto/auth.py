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
# the details of an UNAVAILABLE that control itself answers (it is up, but cannot check a
# credential now: Postgres is unreachable). The agent counts it as an answer, not as the
# address failing: it must still follow redirects to that process once Postgres is back
CONTROL_BUSY = "control cannot serve the stream now"


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


# --- per-lease log tokens: the API mints one per log request, the agent checks it ----------

LOG_TOKEN_VERSION = "v1"


def _log_mac(key: str, lease_id: str, expires: int) -> str:
    msg = f"gpufleet-log:{LOG_TOKEN_VERSION}:{lease_id}:{expires}".encode()
    return hmac.new(key.encode(), msg, hashlib.sha256).hexdigest()


def node_log_key(signing_key: str, node_id: str) -> str:
    """The key one node's log endpoint checks tokens with: derived from the API's signing
    key, so an agent (or a compromised node) can mint tokens for its own leases only."""
    return hmac.new(signing_key.encode(), f"gpufleet-node-log-key:{node_id}".encode(), hashlib.sha256).hexdigest()


def lease_log_token(key: str, lease_id: str, *, now: float, ttl_s: float) -> str:
    """A token that lets its bearer read one lease's logs until ``now + ttl_s``."""
    expires = int(now + ttl_s)
    return f"{LOG_TOKEN_VERSION}.{expires}.{_log_mac(key, lease_id, expires)}"


def check_lease_log_token(key: str, token: str | None, lease_id: str, *, now: float) -> bool:
    """Whether ``token`` was minted with ``key`` for ``lease_id`` and has not expired."""
    if not key or not token:
        return False
    version, _, rest = token.partition(".")
    expires_s, _, mac = rest.partition(".")
    if version != LOG_TOKEN_VERSION or not expires_s.isdigit() or int(expires_s) < now:
        return False
    return hmac.compare_digest(_log_mac(key, lease_id, int(expires_s)).encode(), mac.encode())
