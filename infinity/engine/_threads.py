"""Whether torch's OpenMP threads sleep when they wait; see [Note: threads that wait] in
infinity/__init__.py, which chooses that before torch loads, when it can."""

from __future__ import annotations

import logging
import os

from infinity.memory import usable_cores

logger = logging.getLogger(__name__)

_told = False


def spinning_waits() -> bool:
    """True when the environment leaves OpenMP's threads spinning between parallel regions:
    no OMP_WAIT_POLICY (or "active") and no GOMP_SPINCOUNT of the user's."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().upper()
    return policy != "PASSIVE" and "GOMP_SPINCOUNT" not in os.environ


def check_wait_policy() -> None:
    """Say once (a warning when the machine is busy, else INFO) that waits spin, and how to
    stop it: torch was imported before infinity and the environment sets no policy."""
    global _told
    if _told or not spinning_waits():
        return
    _told = True
    load, cores = os.getloadavg()[0], usable_cores()
    busy = load >= cores + 1
    logger.log(logging.WARNING if busy else logging.INFO,
               "torch's OpenMP threads spin while they wait (torch was imported before infinity "
               "and OMP_WAIT_POLICY is not set)%s: import infinity before torch, or set "
               "OMP_WAIT_POLICY=PASSIVE in the environment", f"; this machine is busy (load "
               f"{load:.1f} on {cores} cores), where that makes steps several times slower"
               if busy else "")
