"""The grader's side of a rank that dies: name it, or judge the reports it left whole.

run_on_ranks turns a failed launch into the learner's message. A rank killed by a signal is
named with the signal and its last lines on stderr (not torchrun's banner or the log paths);
a launch that failed only after every rank reported every key is judged on those reports; a
launch with no rank to blame is named by torchrun's own error, in one line. A judged launch
leaves nothing in the temp dir.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from zero_lab.grading import ExerciseFailed
from zero_lab.grading.remote import (
    RankExercise,
    complete_reports,
    explain_rank_error,
    run_on_ranks,
)
from zero_lab.launch.failures import failure

WORKER = str(Path(__file__).parent / "workers" / "launch_exercise.py")
ABORT_BEFORE = RankExercise(WORKER, "abort_before", lambda: (torch.ones(1),), lambda seed: [1])
ABORT_AFTER = RankExercise(WORKER, "abort_after", lambda: (torch.ones(1),), lambda seed: [1])


def summed(t):
    dist.all_reduce(t)
    return t


def test_reports_complete_before_a_crash_at_exit_are_judged(temp_dir, capsys):
    runs = run_on_ranks("check_summed", [(ABORT_AFTER, [summed])], timeout=120)
    assert runs == {"abort_after:summed": [{"world_size": 3, "value": [3.0]}] * 3}
    # What the learner sees while the ranks run: one line saying so, no log.
    assert capsys.readouterr().out == (
        "check_summed: checking your summed() on 3 ranks (5-10 s)...\n")
    assert list(temp_dir.iterdir()) == []  # judged: neither the code nor the logs are kept


def test_a_rank_that_dies_before_reporting_is_named_with_its_signal_and_stderr(temp_dir):
    with pytest.raises(ExerciseFailed) as info:
        run_on_ranks("check_summed", [(ABORT_BEFORE, [summed])], timeout=120)
    text = str(info.value)
    assert text.startswith("check_summed: rank 1 of 3 died: killed by signal 6 (SIGABRT)"), text
    assert "rank 1 aborts before its report" in text  # its stderr
    assert "=====" not in text and "Logs:" not in text and "launcher.log" not in text
    assert list(temp_dir.iterdir()) == []  # the verdict quotes what the learner needs


# The end of torchrun's log when it failed with no rank to blame (no exception recorded, no
# rank in its failures table): the launcher's own error.
TORCHRUN_ALONE = """\
torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d
store has failed.
============================================================
"""


def test_a_launch_that_fails_with_no_rank_to_blame_gets_a_verdict_not_its_logs(tmp_path):
    (tmp_path / "launcher.log").write_text(TORCHRUN_ALONE)
    exc = failure(Path("zero1_zero2_exercises.py"), 3, tmp_path, returncode=1)
    assert exc.rank is None and "Logs:" in str(exc)  # the LaunchError lists every log
    with pytest.raises(ExerciseFailed) as info:
        explain_rank_error("check_sharded_step", exc, 3)
    text = str(info.value)
    assert text.startswith(
        "check_sharded_step: the launch failed, and no rank recorded an error")
    assert "store has failed." in text  # what torchrun said last, in one line
    assert "=====" not in text and "Logs:" not in text and "rank0.out" not in text
    assert str(tmp_path / "launcher.log") in text  # the one file that says more


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
