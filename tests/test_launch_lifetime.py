"""No process of a launch outlives the process that called torchrun(), however it ends.

A notebook kernel that restarts, a CI job that is cancelled, a terminal closed: the process
that called torchrun() gets SIGTERM or SIGKILL and runs no `finally`. Its torchrun agent and
every rank must go with it, even ranks stuck in a hang. An interrupt (SIGINT, the notebook's
stop button) raises KeyboardInterrupt, and torchrun()'s `finally` stops the launch itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from common import alive

TESTS = Path(__file__).parent
HANG = TESTS / "workers" / "launch_hang.py"
# The launching process: a script that calls torchrun() on ranks that hang forever.
LAUNCHER = (
    "import sys\n"
    "from zero_lab.launch import torchrun\n"
    "torchrun(sys.argv[1], nproc=2, args=[sys.argv[2]], timeout=300, stream=False)\n"
)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


def _launch_pids(out: Path, launcher: subprocess.Popen, nproc: int) -> list[int]:
    """The pids of every rank and of torchrun's agent (their parent), once all ranks run."""
    deadline = time.monotonic() + 60
    while len(list(out.glob("rank*.pids"))) < nproc:
        assert launcher.poll() is None, f"the launcher exited early: {launcher.returncode}"
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.05)
    pids = set()
    for path in out.glob("rank*.pids"):
        pids.update(int(p) for p in path.read_text().split())
    return sorted(pids)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
                         ids=lambda s: s.name)
def test_killing_the_launcher_ends_torchrun_and_every_rank(sig, tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(HANG), str(tmp_path)],
                                cwd=TESTS.parent,  # its zero_lab is the one under test
                                # a killed launch cannot clean up: its folder goes here
                                env={**os.environ, "TMPDIR": str(tmp_path)})
    pids: list[int] = []
    try:
        pids = _launch_pids(tmp_path, launcher, nproc=2)
        assert len(pids) == 3  # two ranks and their agent
        launcher.send_signal(sig)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = {p: _command(p) for p in pids if alive(p)}
        assert left == {}, f"still running 5 s after the launcher got {sig.name}: {left}"
    finally:  # never leave a hang behind, even when the test fails
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
