"""Fixtures shared by the launch tests."""

from __future__ import annotations

import tempfile

import pytest


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """The system temp dir, made empty and private: for this process (where launches keep
    their run folders and the grader the learner's code) and for the processes it starts
    (torchrun's agent, the ranks). Launches that fail on purpose keep their logs there, in
    pytest's own temp dir, not in /tmp."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path
