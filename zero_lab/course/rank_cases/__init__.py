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

import math

import torch
from torch import nn


def seeded_init(module: nn.Module, seed: int) -> nn.Module:
    """Give `module`'s nn.Linear layers (in module order) the values torch's default init
    gives them after `torch.manual_seed(seed)`, drawn from a generator of their own.

    The batch grader judges exercises in threads of one process: a module built by seeding
    torch's global generator took other threads' draws now and then, and a reference
    solution's owned gradient came out "off by 0.182" (tests/test_grading_seeds.py)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, nn.Linear):
                nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5), generator=gen)
                if layer.bias is not None:
                    fan_in = layer.weight.shape[1]
                    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
                    nn.init.uniform_(layer.bias, -bound, bound, generator=gen)
    return module
