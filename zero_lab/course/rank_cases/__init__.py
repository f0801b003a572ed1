"""The cases of the graded exercises that run on ranks, shared by both sides of the check.

A rank script (zero_lab/workers/*_exercises.py) builds each case's inputs from here and runs
the learner's function on them; the judge (zero_lab/grading/nbXX_*.py) builds the same case
from here and computes the expected values with the course's reference, in its own process.
The ranks report what the learner's function produced (values, the collectives it issued,
storage sizes); no comparison with an expected value happens where the learner's code runs.

Every `<exercise>_cases(seed)` returns that exercise's cases: `seed=None` gives the notebook's
own cases, an int draws new ones from the instructor's seed (`python -m zero_lab.grading grade
--seed`), so a learner who memorised the notebook's printed values gains nothing.
These modules import torch and the standard library only: never torch.distributed.
"""
