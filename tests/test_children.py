"""The tests' child-process helper leaves nothing running when a child outlives its timeout."""

import os
import subprocess
import time

import pytest
from children import python_child, torchrun

_RANK = """
import os, sys, time
open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").write(str(os.getpid()))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_torchrun_job_past_its_timeout_leaves_no_rank_running(tmp_path):
    """torchrun starts each rank in a session of its own: killing torchrun alone (what
    subprocess.run does) left the ranks running; python_child's SIGTERM has torchrun stop them."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    with pytest.raises(subprocess.TimeoutExpired):
        python_child([*torchrun(2), str(script), str(tmp_path)], env=env, timeout=20)
    pids = [int((tmp_path / rank).read_text()) for rank in ("0", "1")]
    deadline = time.monotonic() + 15
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, pids)), f"ranks {pids} outlived torchrun"
