"""Bearer tokens -> principals (docs/design.md, Security): deny by default.

A principal is a member of one team or an admin. A team sees and acts on its own
jobs only; admins on all; admin-only routes refuse team tokens whatever the method.
Tokens are compared by their SHA-256 digest, so a lookup does not leak timing about
near-miss tokens.
"""

from __future__ import annotations

import hashlib

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.errors import ApiError
from api.rate_limits import EdgeLimits
from common.settings import Principal, Settings

bearer = HTTPBearer(auto_error=False, description="a token from GPUFLEET_API_TOKENS")

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class TokenTable:
    def __init__(self, settings: Settings) -> None:
        self._by_digest = {_digest(t): p for t, p in settings.api_tokens.items() if t}

    def lookup(self, token: str) -> Principal | None:
        return self._by_digest.get(_digest(token))


async def current_principal(
    request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)
) -> Principal:
    limits: EdgeLimits = request.app.state.limits
    address = request.client.host if request.client is not None else "unknown"
    limits.before_auth(address)
    if creds is None or not creds.credentials:
        limits.auth_failed(address)
        raise ApiError(
            401,
            "unauthenticated",
            "this route needs a bearer token: send the header 'Authorization: Bearer <token>'"
            " (the gpufleet CLI reads it from GPUFLEET_TOKEN or --token)",
            headers=_CHALLENGE,
        )
    table: TokenTable = request.app.state.tokens
    principal = table.lookup(creds.credentials)
    if principal is None:
        limits.auth_failed(address)
        raise ApiError(
            401,
            "unauthenticated",
            "the bearer token is not recognised (check 'Authorization: Bearer <token>', or GPUFLEET_TOKEN for the CLI)",
            headers=_CHALLENGE,
        )
    limits.after_auth(principal.name)
    if not principal.admin and not principal.team:
        # a principal that is neither an admin nor a team member can do nothing
        raise ApiError(403, "forbidden", f"principal {principal.name} belongs to no team and is not an admin")
    request.state.principal = principal
    return principal


async def require_admin(principal: Principal = Depends(current_principal)) -> Principal:
    if not principal.admin:
        raise ApiError(403, "admin_required", "this route is for admins only")
    return principal


def can_see_team(principal: Principal, team: str) -> bool:
    return principal.admin or principal.team == team


def require_team_access(principal: Principal, team: str) -> None:
    """Team routes: a team token may look at its own team only (403 otherwise)."""
    if not can_see_team(principal, team):
        raise ApiError(403, "forbidden", f"principal {principal.name} may not act on team {team}")
