"""The grader's side of a rank that dies: name it, or judge the reports it left whole.

run_on_ranks turns a failed launch into the learner's message. A rank killed by a signal is
named with the signal and its last lines on stderr (not torchrun's banner or the log paths);
a launch that failed only after every rank reported every key is judged on those reports.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from zero_lab.grading import ExerciseFailed
from zero_lab.grading.remote import RankExercise, complete_reports, run_on_ranks

WORKER = str(Path(__file__).parent / "workers" / "launch_exercise.py")
ABORT_BEFORE = RankExercise(WORKER, "abort_before", lambda: (torch.ones(1),))
ABORT_AFTER = RankExercise(WORKER, "abort_after", lambda: (torch.ones(1),))


def summed(t):
    dist.all_reduce(t)
    return t


def test_reports_complete_before_a_crash_at_exit_are_judged():
    runs = run_on_ranks("check_summed", [(ABORT_AFTER, [summed])], timeout=120)
    assert runs == {"abort_after:summed": [{"world_size": 3, "value": [3.0]}] * 3}


def test_a_rank_that_dies_before_reporting_is_named_with_its_signal_and_stderr():
    with pytest.raises(ExerciseFailed) as info:
        run_on_ranks("check_summed", [(ABORT_BEFORE, [summed])], timeout=120)
    text = str(info.value)
    assert text.startswith("check_summed: rank 1 of 3 died: killed by signal 6 (SIGABRT)"), text
    assert "rank 1 aborts before its report" in text  # its stderr
    assert "=====" not in text and "Logs:" not in text and "launcher.log" not in text


def _write(run_dir: Path, rank: int, name: str, data: dict) -> None:
    (run_dir / f"rank{rank}.{name}").write_text(json.dumps(data))


def test_complete_reports_needs_every_key_from_every_rank_and_no_exception(tmp_path):
    keys = ["a:f", "b:g"]
    for rank in range(3):
        _write(tmp_path, rank, "json", {"a:f": {"rank": rank}, "b:g": {}})
    assert complete_reports(tmp_path, 3, keys) == [
        {"a:f": {"rank": r}, "b:g": {}} for r in range(3)]
    assert complete_reports(tmp_path, 4, keys) is None  # rank 3 never reported
    assert complete_reports(None, 3, keys) is None
    _write(tmp_path, 2, "json", {"a:f": {"rank": 2}})
    assert complete_reports(tmp_path, 3, keys) is None  # rank 2 misses "b:g"
    _write(tmp_path, 2, "json", {"a:f": {"rank": 2}, "b:g": {}})
    _write(tmp_path, 1, "error.json", {"rank": 1, "error": "ValueError: no"})
    assert complete_reports(tmp_path, 3, keys) is None  # rank 1 raised
