"""Image references, parsed by the OCI distribution reference grammar, and the registry
allow-list matched by host and repository components (never by text prefix, which let
``registry/../evil`` and ``registry.evil.example/x`` through a ``registry`` entry).

gpufleet takes fully qualified references only: the first component is always the
registry (``registry/llm:1``, ``ghcr.io:443/team/llm@sha256:...``); there is no implied
Docker Hub.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# from the distribution reference grammar (github.com/distribution/reference, grammar in its docs)
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])"
_REGISTRY = re.compile(rf"{_HOST}(?::[0-9]{{1,5}})?")
_PATH_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}")
NAME_MAX = 255
FORM = "registry[:port]/repository[:tag][@digest]"


class ImageRefError(ValueError):
    pass


@dataclass(frozen=True)
class ImageRef:
    registry: str  # lower-cased host[:port]
    repository: tuple[str, ...]  # path components, at least one
    tag: str | None = None
    digest: str | None = None


def _registry(text: str, what: str) -> str:
    if not _REGISTRY.fullmatch(text):
        raise ImageRefError(f"{what}: {text!r} is not a registry host[:port]")
    return text.lower()


def _repository(parts: list[str], what: str) -> tuple[str, ...]:
    for part in parts:
        if not _PATH_COMPONENT.fullmatch(part):
            shown = part if part else "(empty)"
            raise ImageRefError(
                f"{what}: repository component {shown!r} is not lower-case letters and digits joined by . _ __ or -"
            )
    return tuple(parts)


def parse_image_ref(text: str) -> ImageRef:
    """``registry[:port]/repo[/more][:tag][@digest]`` -> ImageRef, or ImageRefError saying what is wrong."""
    rest, digest = text, None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise ImageRefError(f"{text!r}: digest {digest!r} is not algorithm:hex (e.g. sha256:<64 hex>)")
    registry_text, slash, path = rest.partition("/")
    if not slash:
        raise ImageRefError(f"{text!r} names no repository; expected {FORM}")
    tag = None
    last_slash = path.rfind("/")
    colon = path.rfind(":")
    if colon > last_slash:
        path, tag = path[:colon], path[colon + 1 :]
        if not _TAG.fullmatch(tag):
            raise ImageRefError(f"{text!r}: tag {tag!r} is not letters, digits, _ . - (at most 128, not starting . -)")
    if len(registry_text) + 1 + len(path) > NAME_MAX:
        raise ImageRefError(f"{text!r}: the name is longer than {NAME_MAX} characters")
    return ImageRef(
        registry=_registry(registry_text, repr(text)),
        repository=_repository(path.split("/"), repr(text)),
        tag=tag,
        digest=digest,
    )


@dataclass(frozen=True)
class RegistryRule:
    """An allow-list entry: a registry, optionally narrowed to a repository prefix (by component)."""

    registry: str
    repository_prefix: tuple[str, ...] = ()

    def allows(self, ref: ImageRef) -> bool:
        n = len(self.repository_prefix)
        return ref.registry == self.registry and ref.repository[:n] == self.repository_prefix

    def __str__(self) -> str:
        return "/".join((self.registry, *self.repository_prefix))


def parse_registry_rule(text: str) -> RegistryRule:
    """``host[:port]`` or ``host[:port]/repo/prefix`` (a trailing ``/`` is allowed)."""
    registry_text, _, path = text.rstrip("/").partition("/")
    what = f"allowed registry {text!r}"
    return RegistryRule(
        registry=_registry(registry_text, what), repository_prefix=_repository(path.split("/"), what) if path else ()
    )
