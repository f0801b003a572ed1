"""The out-of-memory killer named where it struck (issue 47): the counter of processes it
ended (cgroup v2 memory.events, v1 memory.oom_control, else /proc/vmstat), read before and
after a launch, and a rank killed by SIGKILL said to be its victim in the error's first line,
as a fact where the counter rose and as the likely cause where it did not."""

from __future__ import annotations

import json
from pathlib import Path

from zero_lab.launch import capacity
from zero_lab.launch.failures import failure


def _files(root: Path, files: dict) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


EVENTS = "low 0\nhigh 0\nmax 12\noom 2\noom_kill {}\noom_group_kill 0\n"


def test_oom_kills_are_counted_in_this_process_cgroup_v2(tmp_path):
    events = tmp_path / "sys/fs/cgroup/user.slice/user-1000.slice/memory.events"
    _files(tmp_path, {"proc/self/cgroup": "0::/user.slice/user-1000.slice\n",
                      "sys/fs/cgroup/cgroup.controllers": "memory\n",
                      "sys/fs/cgroup/memory.events": EVENTS.format(40),  # not this cgroup's
                      str(events.relative_to(tmp_path)): EVENTS.format(1),
                      "proc/vmstat": "oom_kill 9\n"})
    before = capacity.oom_kills(root=tmp_path)
    assert (before.count, before.file) == (1, events)
    assert before.since() == 0
    events.write_text(EVENTS.format(3))
    assert before.since() == 2


def test_oom_kills_in_cgroup_v1_and_else_the_machines(tmp_path):
    control = tmp_path / "sys/fs/cgroup/memory/jupyter/user1/memory.oom_control"
    _files(tmp_path, {"proc/self/cgroup": "4:memory:/jupyter/user1\n0::/\n",
                      str(control.relative_to(tmp_path)):
                          "oom_kill_disable 0\nunder_oom 0\noom_kill 4\n",
                      "proc/vmstat": "pgfault 100\noom_kill 9\n"})
    assert capacity.oom_kills(root=tmp_path) == capacity.OomKills(4, control)
    control.unlink()  # no cgroup counter: the machine's, every process's kills
    assert capacity.oom_kills(root=tmp_path) == capacity.OomKills(9, tmp_path / "proc/vmstat")
    assert capacity.oom_kills(root=tmp_path / "nothing") is None


# torchrun's failures table in launcher.log: rank 1 killed by SIGKILL; rank 0 then lost it.
LOG = """\
Failures:
  <NO_OTHER_FAILURES>
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 201) (SIGKILL)
  traceback : Signal 9 (SIGKILL) received by PID 201
"""


def _killed_launch(run_dir: Path) -> None:
    (run_dir / "launcher.log").write_text(LOG)
    (run_dir / "rank0.error.json").write_text(json.dumps(
        {"rank": 0, "time": 1.0, "error": "RuntimeError: Connection reset by peer",
         "traceback": "Traceback ...\nRuntimeError: Connection reset by peer\n"}))
    (run_dir / "rank1.err").write_text("")


def test_a_rank_killed_by_sigkill_is_most_likely_the_oom_killers_in_one_line(tmp_path):
    _killed_launch(tmp_path)
    error = failure(Path("train.py"), 2, tmp_path, 1)
    assert error.rank == 1 and error.cause == (
        "rank 1 of 2 died: killed by signal 9 (SIGKILL) in train.py, most likely by the "
        "out-of-memory killer (the machine or this user's memory limit ran out: fewer ranks "
        "or a smaller model fit)")


def test_a_rank_killed_while_the_oom_counter_rose_is_the_oom_killers_as_a_fact(tmp_path):
    events = tmp_path / "memory.events"
    events.write_text(EVENTS.format(5))
    before = capacity.OomKills(5, events)
    _killed_launch(tmp_path)
    unchanged = failure(Path("train.py"), 2, tmp_path, 1, oom_before=before)
    assert "most likely by the out-of-memory killer" in unchanged.cause  # it did not rise
    events.write_text(EVENTS.format(6))
    error = failure(Path("train.py"), 2, tmp_path, 1, oom_before=before)
    assert error.cause == (
        "rank 1 of 2 died: killed by signal 9 (SIGKILL) in train.py: the out-of-memory killer "
        f"ended it (oom_kill in {events} rose by 1 during the launch; fewer ranks or a "
        "smaller model fit)")
    assert "\n" not in error.cause


def test_a_launch_that_names_no_rank_still_says_the_oom_killer_struck(tmp_path):
    # torchrun itself killed: no table of ranks, no records; only the count says what happened
    events = tmp_path / "memory.events"
    events.write_text(EVENTS.format(2))
    (tmp_path / "launcher.log").write_text("")
    error = failure(Path("train.py"), 2, tmp_path, -9, oom_before=capacity.OomKills(0, events))
    assert error.rank is None and error.cause == (
        "train.py on 2 ranks failed (torchrun exit code -9); the out-of-memory killer ended 2 "
        f"process(es) meanwhile (oom_kill in {events}; fewer ranks or a smaller model fit)")
