"""The image reference grammar and the registry allow-list, as tables and as a property:
every reference built from the grammar parses back to its parts, and a rule allows an image
exactly when host and leading repository components are equal."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.image_ref import ImageRef, ImageRefError, parse_image_ref, parse_registry_rule

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    ("text", "ref"),
    [
        ("registry/llm:1", ImageRef("registry", ("llm",), "1")),
        ("registry/team/llm", ImageRef("registry", ("team", "llm"))),
        ("Reg.Example.com:5000/a_b/c--d:v1.2-rc", ImageRef("reg.example.com:5000", ("a_b", "c--d"), "v1.2-rc")),
        (f"registry/llm@{DIGEST}", ImageRef("registry", ("llm",), None, DIGEST)),
        (f"registry/llm:1@{DIGEST}", ImageRef("registry", ("llm",), "1", DIGEST)),
        ("[fd00::1]:5000/llm:1", ImageRef("[fd00::1]:5000", ("llm",), "1")),
    ],
)
def test_references_parse(text, ref):
    assert parse_image_ref(text) == ref


@pytest.mark.parametrize(
    "text",
    [
        "registry/../evil",
        "registry/",
        "registry/x y",
        "registry",
        "registry//llm",
        "registry/llm:",
        "registry/.llm",
        "registry/llm-",
        "registry/LLM",
        "registry/llm:tä",
        "registry/llm@sha256:abc",
        "-registry/llm",
        "registry:port/llm",
        "/llm",
        "registry/" + "a" * 260,
    ],
)
def test_malformed_references_say_what_is_wrong(text):
    with pytest.raises(ImageRefError, match=repr(text)[1:-1][:8]):
        parse_image_ref(text)


def test_rules_match_by_component_not_text():
    rule = parse_registry_rule("registry/team-a/")
    assert str(rule) == "registry/team-a"
    assert rule.allows(parse_image_ref("registry/team-a/llm:1"))
    assert rule.allows(parse_image_ref("REGISTRY/team-a:1"))
    for other in (
        "registry/team-ab/llm",
        "registry.evil/team-a/llm",
        "registry:5000/team-a/llm",
        "evil/registry/team-a",
    ):
        assert not rule.allows(parse_image_ref(other)), other
    with pytest.raises(ImageRefError, match="allowed registry"):
        parse_registry_rule("registry/../x")


_component = st.from_regex(r"[a-z0-9]{1,4}(?:(?:[._]|__|-{1,2})[a-z0-9]{1,4}){0,2}", fullmatch=True)
_host = st.from_regex(r"[a-z0-9]{1,6}(?:\.[a-z0-9]{1,6}){0,2}", fullmatch=True)


@given(
    host=_host,
    port=st.none() | st.integers(1, 65535),
    repo=st.lists(_component, min_size=1, max_size=4),
    tag=st.none() | st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True),
    prefix_len=st.integers(0, 4),
)
def test_grammar_round_trip_and_component_matching(host, port, repo, tag, prefix_len):
    registry = host if port is None else f"{host}:{port}"
    text = "/".join([registry, *repo]) + (f":{tag}" if tag else "")
    ref = parse_image_ref(text)
    assert ref == ImageRef(registry, tuple(repo), tag)
    prefix = repo[:prefix_len]
    rule = parse_registry_rule("/".join([registry, *prefix]))
    assert rule.allows(ref)
    assert not parse_registry_rule("/".join(["x" + registry, *prefix])).allows(ref)
