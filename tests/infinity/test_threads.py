"""OpenMP's threads sleep when they wait ([Note: threads that wait], infinity/__init__.py):
importing infinity before torch chooses the passive wait policy unless the environment chose
one; an idle team then burns no CPU; initialize() says when it came too late."""

import logging
import os
import subprocess
import sys

import pytest

IDLE_CPU = r"""
import os, sys, time
if sys.argv[1] == "infinity-first":
    import infinity
import torch
a = torch.randn(512, 512)
for _ in range(20):
    a @ a  # parallel regions on the OpenMP team
start = time.process_time()
time.sleep(1.0)  # the team has no work: what it burns now is spinning
print(os.environ.get("OMP_WAIT_POLICY"), time.process_time() - start)
"""


def idle_cpu(order, **env):
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", IDLE_CPU, order], capture_output=True, text=True,
                          env={**environment, "OMP_NUM_THREADS": "2", **env}, timeout=300)
    assert done.returncode == 0, done.stderr
    policy, seconds = done.stdout.split()
    return policy, float(seconds)


def test_infinity_imported_first_makes_waiting_threads_sleep():
    policy, cpu = idle_cpu("infinity-first")
    assert policy == "PASSIVE" and cpu < 0.01
    _, spinning = idle_cpu("torch-only", OMP_WAIT_POLICY="ACTIVE")
    assert spinning > 0.02  # the measure tells: an active team spins through the second


def test_the_environment_and_an_earlier_torch_import_are_left_alone():
    assert idle_cpu("infinity-first", OMP_WAIT_POLICY="active")[0] == "active"
    assert idle_cpu("torch-only")[0] == "None"


@pytest.mark.parametrize("load, level", [(50.0, logging.WARNING), (0.0, logging.INFO)])
def test_initialize_says_when_waits_spin(monkeypatch, caplog, load, level):
    from infinity.engine import _threads

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(_threads, "_told", False)
    monkeypatch.setattr(_threads.os, "getloadavg", lambda: (load, load, load))
    with caplog.at_level(logging.INFO, logger="infinity.engine._threads"):
        _threads.check_wait_policy()
        _threads.check_wait_policy()  # once
    [record] = caplog.records
    assert record.levelno == level and "set OMP_WAIT_POLICY=PASSIVE" in record.getMessage()
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(_threads, "_told", False)
    caplog.clear()
    _threads.check_wait_policy()
    assert not caplog.records
