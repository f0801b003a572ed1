"""No process a rank starts outlives the launch, even one that left the rank's process group
(a double fork, a child in a session of its own): torchrun's agent adopts such orphans as the
child subreaper and ends them when the ranks are done or the launch is stopped (issue 22,
point 16; before, both kinds lived on after torchrun() returned)."""

from __future__ import annotations

import os
import sys
import time

import pytest
from common import alive

from zero_lab.launch import LaunchTimeout, torchrun
from zero_lab.launch.paths import REPO_ROOT

WORKER = REPO_ROOT / "tests" / "workers" / "launch_orphan.py"
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="the subreaper is Linux's (prctl)"),
              pytest.mark.usefixtures("temp_dir")]  # its failed launches' logs: not in /tmp


def left_behind(pid_dir) -> list[int]:
    pids = [int(p.read_text()) for p in sorted(pid_dir.iterdir())]
    assert len(pids) == 4, pids  # 2 ranks x (double fork, own session): all were started
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [p for p in pids if alive(p)]
    for p in survivors:  # do not leave them to the next test
        os.kill(p, 9)
    return survivors


@pytest.mark.parametrize("then", ["finish", "hang"])
def test_what_the_ranks_start_ends_with_the_launch(tmp_path, then):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    if then == "finish":
        torchrun(WORKER, nproc=2, args=[pid_dir, then], timeout=120, stream=False,
                 backend="gloo")
    else:  # stopped at its timeout: the launcher's SIGTERM reaches the agent
        with pytest.raises(LaunchTimeout):
            torchrun(WORKER, nproc=2, args=[pid_dir, then], timeout=15, stream=False,
                     backend="gloo")
    assert left_behind(pid_dir) == []
