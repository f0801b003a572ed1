"""A launch's log folder goes with the process that launched it (issue 47, point 8).

A kernel killed during a launch (a restart, Jupyter's SIGKILL after its grace period) runs no
clean-up: its launch's folder (~52 KB) stayed in the temp dir, one more each time. A failed
launch keeps its folder on purpose, for as long as its error (which names the files) can be
read in the process that raised it. So each folder records its launching process, and the
next launch, in any process, removes the folders whose launching process is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zero_lab.launch import log_dirs, torchrun
from zero_lab.launch.paths import REPO_ROOT

WORKERS = REPO_ROOT / "tests" / "workers"
pytestmark = pytest.mark.usefixtures("temp_dir")  # the folders are looked for in its tmp_path

# A kernel in the middle of a launch whose ranks never finish: it is killed there.
HANGING_KERNEL = (
    "import sys\n"
    "from zero_lab.launch import torchrun\n"
    "torchrun(sys.argv[1], nproc=2, args=[sys.argv[2]], timeout=300, stream=False,"
    " backend='gloo')\n"
)
# A kernel whose launch failed: it prints the folder its error names, then lives on (it reads
# its stdin until the test closes it), as a notebook kernel does after a failed cell.
FAILED_KERNEL = (
    "import sys\n"
    "from zero_lab.launch import LaunchError, torchrun\n"
    "try:\n"
    "    torchrun(sys.argv[1], nproc=2, args=['--fail-rank', '1'], timeout=120, stream=False,"
    " backend='gloo')\n"
    "except LaunchError as exc:\n"
    "    print(exc.run_dir, flush=True)\n"
    "sys.stdin.read()\n"
)


def _kernel(code: str, *args, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=REPO_ROOT,
                            **popen)


def _wait_for(condition, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.05)


def test_a_killed_kernels_folder_goes_and_a_live_kernels_failed_one_stays(temp_dir):
    ranks_out = temp_dir / "hang_pids"
    ranks_out.mkdir()
    killed = _kernel(HANGING_KERNEL, WORKERS / "launch_hang.py", ranks_out)
    alive = _kernel(FAILED_KERNEL, WORKERS / "probe.py", stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, text=True)
    try:
        # The failed launch first: its start (and its sweep) comes before the kill.
        failed_folder = alive.stdout.readline().strip()
        assert failed_folder, "the live kernel's launch did not fail as meant"
        failed_folder = Path(failed_folder)
        _wait_for(lambda: len(list(ranks_out.glob("rank*.pids"))) == 2, "the ranks started")
        killed.send_signal(signal.SIGKILL)  # mid-launch: no `finally` runs
        killed.wait(timeout=10)
        [killed_folder] = temp_dir.glob("zero_lab-launch_hang-*")  # left behind, as before
        assert failed_folder.is_dir() and alive.poll() is None

        torchrun(WORKERS / "probe.py", nproc=2, timeout=120, stream=False, backend="gloo")

        assert not killed_folder.exists(), "the killed kernel's launch folder was left behind"
        assert failed_folder.is_dir(), "a live kernel's failed launch lost the logs it names"
    finally:
        for kernel in (killed, alive):
            if kernel.poll() is None:
                kernel.kill()
            kernel.wait()


def test_the_failed_folder_goes_once_its_kernel_is_gone(temp_dir):
    kernel = _kernel("import sys; sys.stdin.read()", stdin=subprocess.PIPE)
    folder = _owned_by(kernel.pid)
    log_dirs.sweep()
    assert folder.is_dir()  # its kernel lives
    kernel.communicate()  # the kernel ends (a restart, a closed notebook)
    log_dirs.sweep()
    assert not folder.exists()


def test_a_reused_pid_does_not_keep_a_dead_kernels_folder(temp_dir):
    """The pid of a dead kernel can be given to a new process: the start time tells them
    apart (Linux)."""
    if log_dirs.started(os.getpid()) is None:
        pytest.skip("this system's process start times are not read (Linux's /proc)")
    folder = _owned_by(os.getpid(), started="1")  # this pid, an earlier process
    log_dirs.sweep()
    assert not folder.exists()


def test_a_folder_of_another_pid_namespace_is_left_alone(temp_dir):
    """A container sharing the temp dir numbers its processes differently: its pid means
    nothing here, so its folders stay, even when no process here has that pid."""
    if log_dirs.pid_namespace() is None:
        pytest.skip("this system's pid namespaces are not read (Linux's /proc)")
    gone = _exited_pid()
    here = _owned_by(gone)
    there = _owned_by(gone, pid_namespace="pid:[1]")
    log_dirs.sweep()
    assert not here.exists()  # that pid, dead in this namespace: its folder goes
    assert there.is_dir()


def _exited_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def _owned_by(pid: int, **fields) -> Path:
    """A launch folder recorded as made by the process `pid` (with `fields` changed)."""
    folder = log_dirs.new("owned")
    record = folder / log_dirs.OWNER
    owner = json.loads(record.read_text())
    owner.update({"pid": pid, "started": log_dirs.started(pid), **fields})
    record.write_text(json.dumps(owner))
    return folder
