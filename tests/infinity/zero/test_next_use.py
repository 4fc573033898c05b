"""NextUseClock: the one writer of units' next-use hints, in store fetches: trace distances from
the coordinator, the optimizer worker's queue from the engine (each unit's step as many fetches
as it makes), units stepped during backward where the next pass first uses them."""

import math

from infinity.zero.next_use import FAR, NextUseClock


class _Hints:
    """What a TensorStore gets from set_next_use (the only call the clock makes)."""

    def __init__(self):
        self.hints = {}

    def set_next_use(self, hints):
        self.hints.update(hints)


def test_hints_are_distances_in_store_fetches():
    store = _Hints()
    clock = NextUseClock(store)
    clock.set_step_fetches({"a": 3, "b": 5})  # c: not given, one fetch
    clock.released("a", 4)
    clock.released("b", None)
    assert store.hints == {"a": 4.0, "b": FAR}
    # Read by the worker after b's step (queued before them), then one after another.
    clock.read_by_optimizer(["a", "b", "c"], after=["b"])
    assert store.hints == {"a": 6.0, "b": 9.0, "c": 14.0}
    clock.stepped("a")  # no trace to say when the next pass uses it: last
    assert store.hints["a"] == math.inf


def test_a_unit_stepped_during_backward_is_needed_where_the_next_pass_first_uses_it():
    store = _Hints()
    clock = NextUseClock(store, next_pass={"a": 7, "b": None}.get)
    clock.stepped("a")
    clock.stepped("b")  # the trace does not use it
    assert store.hints == {"a": 7.0, "b": math.inf}
