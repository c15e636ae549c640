"""CPython's cyclic garbage collector held off while a placement cycle plans or applies.

A cycle allocates hundreds of thousands of short-lived containers. With the collector on,
every 700 of them start a young-generation collection in the middle of the cycle, and now
and then a full one (tens of milliseconds at 3,000 nodes); most of what those collections
walk would have been freed by reference counting a moment later. Held off for the cycle,
the collections the cycle's allocations call for run once, on the first allocation after
it, over far fewer live objects (``gpufleet bench placement`` reports the collector's time
per cycle; docs/design.md, Known pitfalls).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cyclic_gc_held() -> Iterator[None]:
    """The block runs with the cyclic GC off; it is on again after (also on an exception),
    unless it was already off when the block began. Synchronous code only: an ``await``
    inside would hold the collector off for every task of the process meanwhile."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
