"""Fixtures shared by the store's tests."""

import threading

import pytest


def _in_thread(fn):
    """Start fn in a daemon thread; returns (thread, outcome dict with 'value' or 'error')."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # reported to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@pytest.fixture
def in_thread():
    """in_thread(fn) -> (thread, outcome): fn runs in a daemon thread; outcome gets 'value' or
    'error' (the exception it raised)."""
    return _in_thread
