"""Fixtures shared by the tests: the launch tests' private temp dir, and a figures folder of
the test session's own; and Ctrl-C's default handler, however pytest was started."""

from __future__ import annotations

import signal
import tempfile

import pytest


def pytest_configure(config):
    """Ctrl-C's default handler, wherever pytest was started: `make test` starts two of its
    three pytest processes in the background of a non-interactive shell, which starts them with
    SIGINT ignored (POSIX, job control off; so do nohup and some CI runners). Ignored, it stays
    ignored in every process a test starts: a test that interrupts a launch
    (test_launch_safety) or sends SIGINT to a launcher (test_launch_lifetime) then waits for an
    interrupt that never comes."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def figures_apart(tmp_path_factory):
    """Notebooks the tests run (in JupyterLab, with nbclient) save their figures in a folder of
    this session's, read by zero_lab.launch.paths.figures_dir and inherited by the kernels: `make
    test` runs nbval beside pytest, and its notebooks save the same names in runs/figures."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZERO_LAB_FIGURES_DIR", str(tmp_path_factory.mktemp("figures")))
        yield


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """The system temp dir, made empty and private: for this process (where launches keep
    their run folders and the grader the learner's code) and for the processes it starts
    (torchrun's agent, the ranks). Launches that fail on purpose keep their logs there, in
    pytest's own temp dir, not in /tmp."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path
