"""A rank that dies without a Python exception is named, with its signal or exit code.

When a rank is killed (the out-of-memory killer's SIGKILL, a native abort) or leaves through
os._exit, the ranks waiting for it in a collective fail too ("Connection reset by peer") and
record their exceptions first. The launch error must still name the rank that died.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zero_lab.launch import LaunchError, torchrun
from zero_lab.launch.failures import _rank_exits, _RankExit, _silent_death, failure

DIE = Path(__file__).parent / "workers" / "launch_die.py"


# These launches fail on purpose and keep their logs: in pytest's temp dir, not /tmp.
pytestmark = pytest.mark.usefixtures("temp_dir")  # tests/conftest.py


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("sigkill", "killed by signal 9 (SIGKILL)"),
        ("exit", "exited with code 3"),
        ("abort", "killed by signal 6 (SIGABRT)"),
    ],
)
def test_the_rank_that_died_is_named_with_its_signal_or_code(how, expected):
    with pytest.raises(LaunchError) as info:
        torchrun(DIE, nproc=3, args=[how], timeout=120, stream=False)
    message = str(info.value)
    assert message.startswith(f"rank 1 of 3 died: {expected}"), message
    assert info.value.rank == 1
    assert info.value.cause == message.splitlines()[0]
    assert "rank 1 about to die" in info.value.tail  # its stderr, in the message too
    assert "rank 1 about to die" in message
    assert message.rstrip().endswith(f"torchrun: {info.value.run_dir / 'launcher.log'}")
    if how == "abort":  # the Python stack of a native crash reaches the rank's stderr
        assert "Fatal Python error: Aborted" in info.value.tail
        assert 'launch_die.py", line' in info.value.tail


# torchrun's own account of such a launch (torch 2.13), as _failure reads it from launcher.log.
LOG = """\
W1123 06:20:01.000000 100 torch/distributed/elastic/multiprocessing/api.py:940] Sending \
process 202 closing signal SIGTERM
E1123 06:20:01.100000 100 torch/distributed/elastic/multiprocessing/api.py:1003] failed \
(exitcode: 1) local_rank: 0 (pid: 200) of binary: /usr/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
zero_lab.launch.rank_side FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_06:20:01
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 201) (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 201
[2]:
  time      : 2026-11-23_06:20:01
  host      : box
  rank      : 2 (local_rank: 2)
  exitcode  : -15 (pid: 202) (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 202
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_06:20:01
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 200)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""
RESET = {"rank": 0, "time": 1.0,
         "error": "RuntimeError: [pair.cc:534] Connection reset by peer [127.0.0.1]:1234"}


def test_torchruns_log_gives_each_failed_rank_its_exit(tmp_path):
    (tmp_path / "launcher.log").write_text(LOG)
    exits, stopped = _rank_exits(tmp_path)
    assert exits == {0: _RankExit(0, 1, 200), 1: _RankExit(1, -9, 201), 2: _RankExit(2, -15, 202)}
    assert stopped == {202}


def test_the_silent_death_is_the_root_cause_only_of_what_a_lost_peer_explains(tmp_path):
    (tmp_path / "launcher.log").write_text(LOG)
    exits, stopped = _rank_exits(tmp_path)
    # Rank 0 lost its peer: rank 1, killed, is the cause; rank 2 was stopped by torchrun.
    assert _silent_death([RESET], exits, stopped) == _RankExit(1, -9, 201)
    # No exception recorded at all: the first rank that died on its own is the cause.
    assert _silent_death([], {r: exits[r] for r in (1, 2)}, stopped) == _RankExit(1, -9, 201)
    # A real exception of its own on rank 0 stays the root cause.
    value_error = {**RESET, "error": "ValueError: shapes differ"}
    assert _silent_death([value_error], exits, stopped) is None
    # Nobody died silently: the earliest exception is the cause.
    assert _silent_death([RESET], {0: exits[0]}, stopped) is None


def test_a_record_cut_short_by_a_kill_is_no_record(tmp_path):
    """Rank 2, stopped by torchrun (SIGTERM) while it wrote the exception it got from the lost
    peer, leaves rank2.error.json empty or cut short: that rank recorded nothing, and the
    rank that died is still named (a JSONDecodeError from the parent did happen, once in
    ~2,400 tests, on 2 loaded cores)."""
    (tmp_path / "launcher.log").write_text(LOG)
    (tmp_path / "rank0.error.json").write_text(json.dumps({**RESET, "traceback": "..."}))
    for cut in ("", '{"rank": 2, "ti'):
        (tmp_path / "rank2.error.json").write_text(cut)
        exc = failure(DIE, 3, tmp_path, returncode=1)
        assert str(exc).startswith("rank 1 of 3 died: killed by signal 9 (SIGKILL)"), str(exc)
