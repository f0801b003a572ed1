"""A graded launch that runs past its limit: the limit comes from the cases, and the verdict
says where each rank was, with the advice that fits (zero_lab/grading/hang.py).

Before, every launch had a fixed 120 s or 180 s and one hint, "a collective mismatch", even
for a rank busy in its own loop. One launch here (20 s) keeps rank 1 in its own code while
ranks 0 and 2 wait in a recv; the other cases are read from faulthandler's own text.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from zero_lab import grading
from zero_lab.course.rank_cases.ring import ring_reduce_scatter_cases
from zero_lab.course.rank_cases.zero1_zero2 import owned_range_cases
from zero_lab.grading import ExerciseFailed, hang
from zero_lab.grading.nb02_collectives import RING_HANG_HINT, RING_REDUCE_SCATTER
from zero_lab.grading.nb03_zero1 import OWNED_RANGE
from zero_lab.grading.nb04_zero2 import BUCKET_HOOK
from zero_lab.grading.remote import CASE_S, START_S


def spinning_ring_reduce_scatter(output, input):
    import time

    rank = dist.get_rank()
    if rank == 1:  # busy in its own code, not in a collective (asleep: no core burnt in CI)
        time.sleep(3600)
    dist.recv(output, src=(rank + 1) % dist.get_world_size())


def test_a_spinning_rank_is_named_at_its_line_and_not_blamed_on_a_collective():
    with pytest.raises(ExerciseFailed) as failed:
        grading.check_ring_reduce_scatter(spinning_ring_reduce_scatter, timeout=20)
    text = str(failed.value)
    assert "did not finish within 20 s (every rank was still running)" in text
    assert ("rank 1 was running in your spinning_ring_reduce_scatter() at "
            "`time.sleep(3600)`, in no collective") in text
    for rank in (0, 2):
        assert (f"rank {rank} was waiting in dist.recv in your spinning_ring_reduce_scatter() "
                "at `dist.recv(output, src=(rank + 1) % dist.get_world_size())`") in text
    assert "rank 1 never reached its next collective" in text
    assert RING_HANG_HINT not in text


def test_the_limit_is_derived_from_the_cases():
    assert RING_REDUCE_SCATTER.limit() == START_S + CASE_S * len(ring_reduce_scatter_cases(None))
    assert OWNED_RANGE.limit(3) == START_S + CASE_S * len(owned_range_cases(3))
    assert OWNED_RANGE.limit() > BUCKET_HOOK.limit()  # 9 cases get more time than 2


STACKS = '''Timeout (0:00:27)!
Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait

Thread 0x00007f0000000002 (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 2101 in {op}
  File "/x/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "<your function>", line {line} in my_ring
  File "/x/zero_lab/workers/ring_exercise.py", line 40 in run_ring_reduce_scatter
  File "/x/zero_lab/course/exercises.py", line 137 in run_exercises
'''
SOURCE = "def my_ring(output, input):\n    dist.all_reduce(input)\n    req.wait()\n"


@pytest.mark.parametrize("op, line, waiting, code", [
    ("all_reduce", 2, "dist.all_reduce", "dist.all_reduce(input)"),
    ("get_rank", 2, None, "dist.all_reduce(input)"),  # a query returns at once: not waiting
    ("WORLD", 2, None, "dist.all_reduce(input)"),  # the property behind get_rank(), as seen
])
def test_a_stack_is_read_as_waiting_or_running(tmp_path, op, line, waiting, code):
    (tmp_path / "rank0.stacks").write_text(STACKS.format(op=op, line=line))
    [place] = hang.places(tmp_path, [0, 1], SOURCE)  # rank 1 wrote nothing: left out
    assert (place.rank, place.waiting_in, place.function, place.code) == (
        0, waiting, "my_ring", code)


def test_a_request_wait_is_waiting_and_every_rank_waiting_is_a_mismatch(tmp_path):
    text = STACKS.replace('  File "/x/torch/distributed/distributed_c10d.py", line 2101 in {op}\n'
                          '  File "/x/torch/distributed/c10d_logger.py", line 81 in wrapper\n',
                          "").format(line=3)
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.stacks").write_text(text)
    found = hang.places(tmp_path, [0, 1], SOURCE)
    assert [p.waiting_in for p in found] == ["a request's .wait()"] * 2
    assert hang.all_waiting(found)
