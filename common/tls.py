"""TLS on the platform's three network links (docs/security.md, "Network"):

* a client (the CLI, a user's script) to the API: the API serves HTTPS with
  ``api_tls_cert_file`` / ``api_tls_key_file``;
* an agent to control's gRPC server: ``control_tls`` on both sides; control serves with
  ``control_tls_cert_file`` / ``control_tls_key_file``;
* the API to an agent's log endpoint: the agent serves HTTPS with ``agent_tls_cert_file`` /
  ``agent_tls_key_file`` and advertises ``https://host:port``.

A client checks the server's certificate (and its name) against ``tls_ca_file``, or the
system's trust store when it is unset. Unset certificates mean plain text, as on ``make up``
(everything on 127.0.0.1) or behind a TLS-terminating proxy or mesh.

Every process's client to Temporal: ``temporal_tls``, checked against
``temporal_tls_ca_file`` (Temporal's CA is not necessarily the platform's), with a client
certificate for mutual TLS where Temporal asks for one (``temporal_tls_cert_file``).

A private key file must be readable by its owner alone (as secret files are: common.secrets).
"""

from __future__ import annotations

import ssl
from functools import lru_cache
from pathlib import Path
from typing import Any


class TlsSettingsError(ValueError):
    pass


def _pair(cert: Path | None, key: Path | None, what: str) -> tuple[Path, Path] | None:
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise TlsSettingsError(f"{what}: a certificate needs its key and a key its certificate")
    try:
        mode = Path(key).stat().st_mode
    except OSError as e:
        raise TlsSettingsError(f"{what}: cannot read {key}: {e.strerror or e}") from e
    if mode & 0o077:
        raise TlsSettingsError(f"{what}: {key} is readable by others (mode {mode & 0o777:o}): chmod 600 it")
    return Path(cert), Path(key)


def server_context(cert: Path | None, key: Path | None, what: str) -> ssl.SSLContext | None:
    """A server's context for ``asyncio.start_server`` (TLS 1.2 or later); None: plain text."""
    pair = _pair(cert, key, what)
    if pair is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(pair[0]), str(pair[1]))
    except (OSError, ssl.SSLError) as e:
        raise TlsSettingsError(f"{what}: cannot load {pair[0]} with {pair[1]}: {e}") from e
    return ctx


def client_verify(settings) -> ssl.SSLContext | bool:
    """What an HTTPS client passes as httpx's ``verify``: the platform's CA, or the system's."""
    if settings.tls_ca_file is None:
        return True
    path = Path(settings.tls_ca_file)
    try:
        return _ca_context(str(path), path.stat().st_mtime_ns)
    except (OSError, ssl.SSLError) as e:
        raise TlsSettingsError(f"tls_ca_file: cannot load {path}: {e}") from e


@lru_cache(maxsize=8)
def _ca_context(path: str, _mtime_ns: int) -> ssl.SSLContext:
    """One context per CA file and version (the API opens one per log request; a replaced file is read again)."""
    ctx = ssl.create_default_context(cafile=path)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def uvicorn_tls(settings) -> dict[str, Any]:
    """uvicorn's arguments for the API's certificate ({} for plain HTTP)."""
    cert, key = settings.api_tls_cert_file, settings.api_tls_key_file
    # a bad pair fails here, with the setting names, not inside uvicorn
    if server_context(cert, key, "api_tls_cert_file/api_tls_key_file") is None:
        return {}
    return {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}


def api_scheme(settings) -> str:
    return "https" if settings.api_tls_cert_file else "http"


def grpc_server_credentials(settings):
    """control's gRPC server credentials; None: ``control_tls`` is off."""
    if not settings.control_tls:
        return None
    import grpc

    cert, key = settings.control_tls_cert_file, settings.control_tls_key_file
    if server_context(cert, key, "control_tls_cert_file/control_tls_key_file") is None:
        raise TlsSettingsError("control_tls needs control_tls_cert_file and control_tls_key_file")
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])


def grpc_channel_credentials(settings):
    """An agent's credentials for control's gRPC server; None: ``control_tls`` is off."""
    if not settings.control_tls:
        return None
    import grpc

    try:
        roots = Path(settings.tls_ca_file).read_bytes() if settings.tls_ca_file else None
    except OSError as e:
        raise TlsSettingsError(f"tls_ca_file: cannot read {settings.tls_ca_file}: {e.strerror or e}") from e
    return grpc.ssl_channel_credentials(root_certificates=roots)


def temporal_tls(settings):
    """``Client.connect``'s ``tls``: a TLSConfig with ``temporal_tls``, else False (plain text)."""
    if not settings.temporal_tls:
        return False
    from temporalio.service import TLSConfig

    pair = _pair(settings.temporal_tls_cert_file, settings.temporal_tls_key_file, "temporal_tls_cert_file/_key_file")
    try:
        return TLSConfig(
            server_root_ca_cert=Path(settings.temporal_tls_ca_file).read_bytes()
            if settings.temporal_tls_ca_file
            else None,
            client_cert=pair[0].read_bytes() if pair else None,
            client_private_key=pair[1].read_bytes() if pair else None,
            domain=settings.temporal_tls_server_name,
        )
    except OSError as e:
        raise TlsSettingsError(f"temporal_tls: cannot read {e.filename}: {e.strerror or e}") from e
