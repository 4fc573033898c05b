"""Child Python processes of the tests import this checkout, wherever pytest was started.

A `python -c` child puts its working directory first on sys.path and a `-m` child may find
another checkout (or the installed package), so children run in the repository root with it
on PYTHONPATH, found from this file's location.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# For a child whose peak RSS a test bounds: glibc's initial mmap threshold (128 KiB), fixed. The
# dynamic one rises each time a mapped block is freed; building a small model on meta frees
# 1-8 MiB CPU tensors, so later ones of those sizes came from the heap, and how much of it stayed
# resident varied the figures by up to 40 MiB from run to run. Fixed, freed blocks leave the
# process: growth cannot hide in memory that stayed resident.
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}


def child_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`base` (default: this environment) and `extra`, with the repository first on PYTHONPATH."""
    env = {**(os.environ if base is None else base), **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def python_child(args: list[str], *, env: dict[str, str] | None = None,
                 timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
    """Run `python *args` to the end in the repository root; output captured as text.

    Past `timeout`, or when the test is interrupted (pytest-timeout), the child gets SIGTERM
    and, 10 s later, SIGKILL: torchrun stops its ranks on SIGTERM, while they outlive a
    SIGKILL of torchrun (each in a session of its own), as subprocess.run would leave them."""
    with subprocess.Popen([sys.executable, *args], cwd=ROOT, env=child_env(env),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          **kwargs) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except BaseException:
            child.terminate()
            try:
                child.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
            raise
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


def torchrun(world: int) -> list[str]:
    """`python` arguments that start torchrun with `world` local ranks on a port the rendezvous
    binds itself (`--standalone`): a port picked by the test and bound later by torchrun can be
    taken in between by another test's connection (seen once under pytest-xdist)."""
    return ["-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
            "--nproc_per_node", str(world)]
