"""The activities JobWorkflow calls are typed interfaces; the workers register implementations
under the same names with the same parameter and return types."""

from __future__ import annotations

import typing

import pytest
from temporalio import activity

from activities.job_activities import JobActivities
from common import contracts
from worker_agent.node import FleetActivities, NodeAgent
from workflows.activity_interfaces import INTERFACES


def _definition(fn) -> tuple[str, list, object]:
    name = activity._Definition.must_from_callable(fn).name
    hints = typing.get_type_hints(fn)
    ret = hints.pop("return")
    return name, list(hints.values()), ret


def test_every_control_interface_has_its_implementation():
    impl = {(d := _definition(fn))[0]: d for fn in JobActivities(None, None).all()}  # type: ignore[arg-type]
    for iface in INTERFACES:
        name, params, ret = _definition(iface)
        assert name in impl, f"no implementation of {name}"
        assert impl[name] == (name, params, ret), f"{name}: the implementation's signature differs"
    assert set(impl) == {_definition(i)[0] for i in INTERFACES}


@pytest.mark.parametrize("owner", [NodeAgent, FleetActivities])
def test_the_node_activities_implement_the_contract(owner):
    for iface in (contracts.start_task, contracts.stop_task):
        name, params, ret = _definition(iface)
        impl = getattr(owner, name)
        assert _definition(impl) == (name, params, ret)


async def test_an_interface_is_never_run():
    with pytest.raises(NotImplementedError):
        await contracts.start_task(None)  # type: ignore[arg-type]
