"""A launch is safe on a café Wi-Fi and a shared teaching server (issue 34).

- nothing it starts listens beyond loopback: not torchrun's rendezvous store, nor the
  ranks' process-group store, nor gloo's sockets;
- inherited launcher variables (a Kubeflow pod's PET_*) do not turn it into a multi-node
  launch that waits for nodes that never come;
- a killed launcher (a kernel's hard restart) leaves nothing running that a rank started;
- an interrupt leaves no reader thread, open file or log folder behind;
- nproc is checked against the cores and the memory before anything starts;
- a full temporary folder or a read-only course folder is named, with its cause.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from common import alive

from zero_lab import launch
from zero_lab.launch import LaunchError, capacity, torchrun
from zero_lab.launch.paths import REPO_ROOT

TESTS = Path(__file__).parent
WORKERS = TESTS / "workers"
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
LOOPBACK = {"127.0.0.1", "::1"}


@LINUX
def test_a_launch_listens_on_loopback_only(temp_dir):
    result = torchrun(WORKERS / "launch_listeners.py", nproc=2, backend="gloo", stream=False,
                      timeout=120)
    report = result.ranks[0]
    assert report["processes"] == 3  # the agent and two ranks were looked at
    exposed = [s for s in report["listeners"] if s[1] not in LOOPBACK]
    assert exposed == [], f"listening beyond loopback during a launch: {exposed}"
    assert report["gloo_ifname"] in {"lo", "lo0"}  # gloo's own sockets on the loopback


def test_inherited_launcher_variables_are_cleared_and_named(temp_dir, monkeypatch):
    # A Kubeflow PyTorchJob pod sets these; torchrun reads PET_* as its own options.
    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "someone-elses-job")
    with pytest.warns(UserWarning, match="PET_NNODES.*TORCHELASTIC_RUN_ID"):
        result = torchrun(WORKERS / "probe.py", nproc=2, backend="gloo", stream=False,
                          timeout=60)
    assert len(result.ranks) == 2
    assert result.ranks[1]["pet"] == []  # none reached the ranks
    assert result.ranks[1]["run_id"] != "someone-elses-job"


LAUNCH_ORPHANS = (
    "import sys\n"
    "from zero_lab.launch import torchrun\n"
    "torchrun(sys.argv[1], nproc=2, args=[sys.argv[2], 'hang'], timeout=300, stream=False,\n"
    "         backend='gloo')\n"
)


@LINUX
def test_a_killed_launcher_leaves_nothing_a_rank_started(tmp_path):
    """A kernel's hard restart SIGKILLs it: no `finally` runs in it, yet what the ranks
    started (here a double fork and a child in a session of its own, on each rank) ends."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    kernel = subprocess.Popen(
        [sys.executable, "-c", LAUNCH_ORPHANS, str(WORKERS / "launch_orphan.py"), str(pid_dir)],
        cwd=REPO_ROOT, env={**os.environ, "TMPDIR": str(tmp_path)})
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(list(pid_dir.iterdir())) < 4:
            assert kernel.poll() is None and time.monotonic() < deadline, "ranks never started"
            time.sleep(0.05)
        time.sleep(0.2)  # every pid file is written whole
        pids = [int(p.read_text()) for p in pid_dir.iterdir()]
        kernel.kill()
        kernel.wait()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in pids if alive(p)] == []
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _files_open_under(folder: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return found


@LINUX
def test_an_interrupted_launch_leaves_no_thread_file_or_folder(temp_dir):
    (temp_dir / "pids").mkdir()
    threads_before = set(threading.enumerate())
    timer = threading.Timer(1.5, lambda: __import__("_thread").interrupt_main())
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            torchrun(WORKERS / "launch_hang.py", nproc=2, args=[temp_dir / "pids"],
                     backend="gloo", stream=False, timeout=120)
    finally:
        timer.cancel()
    time.sleep(0.2)
    assert [t for t in threading.enumerate() if t not in threads_before and t is not timer] == []
    assert _files_open_under(temp_dir) == []
    assert [p.name for p in temp_dir.glob("zero_lab-*")] == []  # no log folder left


def test_nproc_far_above_the_cores_is_refused_before_anything_starts(temp_dir, monkeypatch):
    monkeypatch.setattr(capacity, "available_cores", lambda: 2)
    started = []
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(ValueError, match=r"nproc=64 ranks on 2 cores.*nproc <= 8"):
        torchrun(WORKERS / "probe.py", nproc=64, backend="gloo")
    assert started == []


def test_nproc_above_the_memory_is_refused_with_the_numbers(temp_dir, monkeypatch):
    monkeypatch.setattr(capacity, "available_cores", lambda: 16)
    monkeypatch.setattr(capacity, "available_memory", lambda: 1000 * capacity.MiB)
    with pytest.raises(ValueError, match=r"nproc=8 ranks need about 1,600 MiB.*1,000 MiB"):
        torchrun(WORKERS / "probe.py", nproc=8, backend="gloo")


def test_a_full_temporary_folder_is_named(temp_dir, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "mkdtemp", full)
    with pytest.raises(OSError, match=rf"{temp_dir}.*no space left.*TMPDIR"):
        torchrun(WORKERS / "probe.py", nproc=2, backend="gloo")


def test_a_launch_that_failed_on_a_full_disk_says_so_and_its_logs_can_go(temp_dir,
                                                                         monkeypatch):
    monkeypatch.setattr("zero_lab.launch.env.free_bytes", lambda path: 4096)
    with pytest.raises(LaunchError, match=r"4 KiB free.*full") as caught:
        torchrun(WORKERS / "launch_die.py", nproc=2, backend="gloo", stream=False, timeout=60,
                 args=["exit"])
    # kept for reading, and named in the message; a failure shown on purpose removes them
    assert caught.value.run_dir.is_dir() and str(caught.value.run_dir) in str(caught.value)
    caught.value.remove_logs()
    assert list(temp_dir.glob("zero_lab-*")) == []


def test_rank_script_names_a_read_only_folder(tmp_path, monkeypatch):
    from IPython.core.error import UsageError

    monkeypatch.chdir(tmp_path)
    real_open = Path.open

    def read_only(self, mode="r", *args, **kwargs):
        if "x" in mode or "w" in mode:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", read_only)
    with pytest.raises(UsageError, match=r"workers/hello\.py.*read-only.*writable"):
        launch.rank_script("workers/hello.py", "print('hi')\n")
    assert not (tmp_path / "workers" / ".hello.py").exists()


def test_rank_script_refuses_to_write_beside_the_package(monkeypatch):
    from IPython.core.error import UsageError

    monkeypatch.chdir(REPO_ROOT)  # papermill run from the repository root, without --cwd
    with pytest.raises(UsageError, match=r"notebooks.*--cwd"):
        launch.rank_script("workers/stray.py", "print('hi')\n")
    assert not (REPO_ROOT / "workers").exists()
