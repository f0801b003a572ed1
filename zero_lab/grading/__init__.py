"""Graded exercises: the checks notebooks call, and the student-copy generator.

How an exercise looks in a notebook: one cell holds a function the learner completes, its
reference solution fenced by `### BEGIN SOLUTION` / `### END SOLUTION`; the next cell calls
`zero_lab.grading.check_<name>(the_function)`, which prints one ✓ line or raises
`ExerciseFailed` with the failing case, expected vs got, and a hint (never a traceback).
`python -m zero_lab.grading student --out build/student` writes the learners' copies;
`python -m zero_lab.grading grade SUBMISSIONS` grades a folder of them (batch.py).

    framework.py        ExerciseFailed, Case, same, run_cases: how to write a check
    student.py          the student copies: solutions replaced by stubs, outputs cleared
    remote.py           running the learner's functions on 3 ranks (zero_lab/workers/)
    batch.py            `grade`: a folder of submissions graded outside the students' kernels
    sandbox.py          the child process one exercise of one submission runs in
    submissions.py      each exercise's `def`s taken from a submission with the AST
    hidden.py           the kernel exercises' cases, drawn from the instructor's seed
    reports.py          grades.csv, feedback per student, Gradescope's results.json, summary
    nb01_memory.py      bytes per parameter, per-rank model states, the largest model
    nb02_collectives.py the ring reduce-scatter (3 ranks), bytes a ring sends
    nb03_zero1.py       stage 1: the owned slice, the sharded optimizer step (3 ranks)
    nb04_zero2.py       stage 2: the bucketed gradient hook (3 ranks)
    nb05_zero3.py       stage 3: materialize/release, the post-backward reduce-scatter (3 ranks)
    nb06_profiler.py    reading a trace: exposed communication, the most exposed unit
    nb07_scaling.py     from how many GPUs each stage fits (what turns a stage choice)
    nb08_knobs.py       bytes per optimizer step under accumulation; HSDP's bytes per level
    nb09_fsdp2.py       the gradient norm from the shards' norms; the fully_shard plan of a model

This is the parent side: it starts the rank scripts in zero_lab/workers/, never imports them;
what both sides need (GradBucket, BareUnit) lives in `zero_lab.course.exercises`.
"""

from zero_lab.grading.framework import Case, ExerciseFailed, fail, passed, run_cases, same
from zero_lab.grading.nb01_memory import (
    check_bytes_per_param,
    check_largest_model,
    check_per_rank_bytes,
)
from zero_lab.grading.nb02_collectives import check_ring_bytes_sent, check_ring_reduce_scatter
from zero_lab.grading.nb03_zero1 import check_owned_range, check_sharded_step
from zero_lab.grading.nb04_zero2 import check_bucket_hook
from zero_lab.grading.nb05_zero3 import check_materialize_release, check_post_backward
from zero_lab.grading.nb06_profiler import check_exposed_communication, check_most_exposed_unit
from zero_lab.grading.nb07_scaling import check_stage_choice
from zero_lab.grading.nb08_knobs import check_accumulation_bytes, check_hsdp_bytes
from zero_lab.grading.nb09_fsdp2 import check_fully_shard_plan, check_global_grad_norm
from zero_lab.grading.student import (
    BEGIN_MARK,
    END_MARK,
    main,
    stub_solutions,
    student_notebook,
    write_student_copies,
)

__all__ = [
    "BEGIN_MARK",
    "END_MARK",
    "Case",
    "ExerciseFailed",
    "check_accumulation_bytes",
    "check_bucket_hook",
    "check_bytes_per_param",
    "check_exposed_communication",
    "check_fully_shard_plan",
    "check_global_grad_norm",
    "check_hsdp_bytes",
    "check_largest_model",
    "check_materialize_release",
    "check_most_exposed_unit",
    "check_owned_range",
    "check_per_rank_bytes",
    "check_post_backward",
    "check_ring_bytes_sent",
    "check_ring_reduce_scatter",
    "check_sharded_step",
    "check_stage_choice",
    "fail",
    "main",
    "passed",
    "run_cases",
    "same",
    "student_notebook",
    "stub_solutions",
    "write_student_copies",
]
