"""Layer traces: look-ups, memoisation per pass key, divergence."""

import pytest

from infinity.zero import Trace, TraceBook


def test_trace_lookups():
    trace = Trace([0, 1, 2, 1, 0], numels=[10, 20, 30])
    assert trace.next_pos == (4, 3, 5, 5, 5)
    assert trace.first_pos == {0: 0, 1: 1, 2: 2}
    assert trace.numel_between(1, 4) == 20 + 30 + 20
    assert trace.numel_between(2, 2) == 0


def test_a_pass_follows_its_trace_and_a_divergence_records_a_new_one():
    book = TraceBook([1, 1, 1, 1])
    first = book.start("train")
    assert first.trace is None
    for u in (0, 1, 2):
        assert not first.observe(u)
    book.finish(first)
    assert book.count("train") == 1 and book.count("eval") == 0

    same = book.start("train")
    assert same.started_on_trace and same.trace.units == (0, 1, 2)
    for u in (0, 1, 2):
        same.observe(u)
    book.finish(same)
    assert book.count("train") == 1

    branch = book.start("train")
    assert not branch.observe(0)
    assert branch.observe(3)  # left the trace here
    assert branch.trace is None and branch.diverged
    assert not branch.observe(2)  # reported once
    book.finish(branch)
    assert book.count("train") == 2
    # Both routes are kept; the most recent is tried first, and a prefix selects the route.
    again = book.start("train")
    assert again.trace.units == (0, 3, 2)
    again.observe(0)
    again.observe(1)
    assert again.trace.units == (0, 1, 2) and not again.diverged


def test_the_book_keeps_at_most_max_traces_per_key():
    book = TraceBook([1] * 5, max_traces=2)
    for route in ([0], [1], [2]):
        cursor = book.start("k")
        for u in route:
            cursor.observe(u)
        book.finish(cursor)
    assert book.count("k") == 2
    assert [t.units for t in book.start("k").candidates] == [(2,), (1,)]
    with pytest.raises(ValueError, match="max_traces"):
        TraceBook([1], max_traces=0)


def test_a_pass_that_stops_early_is_memoised_as_its_own_trace():
    book = TraceBook([1, 1])
    for route in ([0, 1], [0]):
        cursor = book.start("k")
        for u in route:
            cursor.observe(u)
        book.finish(cursor)
    assert book.count("k") == 2


def test_a_new_key_borrows_the_traces_of_other_keys():
    book = TraceBook([1, 1, 1])
    train = book.start("train")
    for u in (0, 1, 2, 2, 1, 0):  # forward and backward
        train.observe(u)
    book.finish(train)
    evaluation = book.start("eval")
    assert evaluation.started_on_trace
    for u in (0, 1, 2):
        assert not evaluation.observe(u)
    book.finish(evaluation)  # shorter than what it followed: memoised under its own key
    assert book.count("eval") == 1 and book.start("eval").trace.units == (0, 1, 2)
