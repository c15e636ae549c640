"""``common.gc_hold.cyclic_gc_held``: the collector is off within, back as it was after."""

from __future__ import annotations

import gc

import pytest

from common.gc_hold import cyclic_gc_held


@pytest.fixture(autouse=True)
def _collector_on():
    was_on = gc.isenabled()
    gc.enable()
    yield
    if was_on:  # as it was before the test, whatever the test left
        gc.enable()
    else:
        gc.disable()


def test_off_within_and_on_after() -> None:
    with cyclic_gc_held():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_on_again_after_an_exception() -> None:
    with pytest.raises(RuntimeError), cyclic_gc_held():
        raise RuntimeError("the plan failed")
    assert gc.isenabled()


def test_left_off_when_it_was_off() -> None:
    gc.disable()
    with cyclic_gc_held():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_nested_hold_leaves_the_outer_one_in_force() -> None:
    with cyclic_gc_held():
        with cyclic_gc_held():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_cycles_made_within_are_collected_after() -> None:
    """Held off, not lost: garbage in reference cycles made within is freed by a later collection."""

    class Node:
        pass

    with cyclic_gc_held():
        a, b = Node(), Node()
        a.other, b.other = b, a
        del a, b
        found = [o for o in gc.get_objects() if isinstance(o, Node)]
        assert len(found) == 2
        del found
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, Node)]
