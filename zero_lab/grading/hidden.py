"""The batch grader's hidden cases: for each exercise that runs in the kernel (input -> output,
no ranks), where its code lives, what its function may use, and its cases drawn from a seed.

    HIDDEN["check_bytes_per_param"].cases(random.Random(f"{seed}:{check}")) -> [Case, ...]

`cases(None)` gives the notebook's own cases, the ones its `check_*` runs; `cases(rng)` draws
other inputs from `rng` (recipes, stages, world sizes, sizes, ops, event lists, models), so
a notebook's printed outputs are worth nothing, and computes every expected value with the
course's reference in this process. Each `<exercise>_cases` makes sure every known mistake
gives another value than the reference on at least one case, whatever the seed
(tests/test_grading_hidden.py draws 20). Cases' args are plain values or the package's
dataclasses (`zero_lab.profiling.trace.Event`): the grader pickles them to the child.

`preamble` is what the child runs before the learner's `def`s: the imports the notebook has
run by the time the exercise's cell runs that its function may use, nothing else. Each line
says which notebook cell it comes from (by cell id). Everything else the notebook defines
(its plots, the calculators that give the answer) is left out on purpose.

Not here: the exercises on ranks (notebooks 02-05's launches, `check_owned_range` among
them: notebook 03's owned slice runs on 3 ranks inside a real all-gather), which the grader
runs through their own checks (batch.ON_RANKS).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zero_lab.grading import nb01_memory as nb01
from zero_lab.grading import nb02_collectives as nb02
from zero_lab.grading import nb06_profiler as nb06
from zero_lab.grading import nb07_scaling as nb07
from zero_lab.grading import nb08_knobs as nb08
from zero_lab.grading import nb09_fsdp2 as nb09
from zero_lab.grading.framework import Case, same

TIMEOUT_S = 20.0  # each exercise's limit: the references run in milliseconds


@dataclass(frozen=True)
class Hidden:
    """One kernel exercise, as the batch grader needs it."""

    check: str                 # "check_bytes_per_param"
    notebook: str              # "01_memory_accounting.ipynb"
    functions: tuple[str, ...]  # the `def`s of its cell, the first one called
    preamble: str              # source run before the learner's `def`s
    timeout_s: float
    cases: Callable[[random.Random | None], list[Case]]
    compare: Callable[[Any, Any], bool]
    wrong_answers: tuple[tuple[Callable, str], ...]  # (mistake function, explanation)


# Notebook 01: `import math` from its imports cell (id 374ae218), for ceil(Ψ/N_d).
NB01_PREAMBLE = "import math  # notebook 01, imports cell 374ae218\n"
# Notebook 02: its imports (torch, the collectives, the launcher) give bytes_sent nothing.
NB02_PREAMBLE = ""
# Notebook 06: the interval helpers exercise 1 names, and `unit_of`, which exercise 2 names,
# both from its imports cell (id f597d6cb).
NB06_PREAMBLE = ("from zero_lab.profiling import intervals as iv  # notebook 06, cell f597d6cb\n"
                 "from zero_lab.profiling.analysis import unit_of  # notebook 06, cell f597d6cb\n")
# Notebook 07: `import math` from its parameter check cell (id 75794248), for math.ceil.
NB07_PREAMBLE = "import math  # notebook 07, cell 75794248\n"
# Notebook 08: `import math` from its parameter check and imports cells (2c56ee50, 694bf5be).
NB08_PREAMBLE = "import math  # notebook 08, cells 2c56ee50 and 694bf5be\n"
# Notebook 09: `math` (math.inf, exercise 1) and `nn` (nn.Module in exercise 2's signature),
# both from its imports cell (id 0f9a7c31).
NB09_PREAMBLE = ("import math  # notebook 09, imports cell 0f9a7c31\n"
                 "from torch import nn  # notebook 09, imports cell 0f9a7c31\n")

NB01 = "01_memory_accounting.ipynb"
NB06 = "06_profiler_analysis.ipynb"
NB08 = "08_knobs.ipynb"
NB09 = "09_fsdp2.ipynb"

_ENTRIES = (
    Hidden("check_bytes_per_param", NB01, ("my_bytes_per_param",), NB01_PREAMBLE, TIMEOUT_S,
           nb01.bytes_per_param_cases, same, nb01.BYTES_PER_PARAM_WRONG),
    Hidden("check_per_rank_bytes", NB01, ("my_per_rank_bytes",), NB01_PREAMBLE, TIMEOUT_S,
           nb01.per_rank_bytes_cases, same, nb01.PER_RANK_WRONG),
    Hidden("check_largest_model", NB01, ("my_largest_model",), NB01_PREAMBLE, TIMEOUT_S,
           nb01.largest_model_cases, nb01.close, nb01.LARGEST_MODEL_WRONG),
    Hidden("check_ring_bytes_sent", "02_collectives.ipynb", ("bytes_sent",), NB02_PREAMBLE,
           TIMEOUT_S, nb02.ring_bytes_sent_cases, same, nb02.RING_BYTES_WRONG),
    Hidden("check_exposed_communication", NB06, ("exposed_communication",), NB06_PREAMBLE,
           TIMEOUT_S, nb06.exposed_communication_cases, same, nb06.EXPOSED_WRONG),
    Hidden("check_most_exposed_unit", NB06, ("most_exposed_unit",), NB06_PREAMBLE, TIMEOUT_S,
           nb06.most_exposed_unit_cases, same, nb06.UNIT_WRONG),
    Hidden("check_stage_choice", "07_choosing_a_stage.ipynb", ("fewest_gpus",), NB07_PREAMBLE,
           TIMEOUT_S, nb07.stage_choice_cases, same, nb07.STAGE_CHOICE_WRONG),
    Hidden("check_accumulation_bytes", NB08, ("accumulation_bytes",), NB08_PREAMBLE, TIMEOUT_S,
           nb08.accumulation_bytes_cases, nb08.nonzero_ops_equal, nb08.ACCUMULATION_WRONG),
    Hidden("check_hsdp_bytes", NB08, ("hsdp_bytes",), NB08_PREAMBLE, TIMEOUT_S,
           nb08.hsdp_bytes_cases, nb08.hsdp_compare, nb08.HSDP_WRONG),
    Hidden("check_global_grad_norm", NB09, ("global_grad_norm",), NB09_PREAMBLE, TIMEOUT_S,
           nb09.global_grad_norm_cases, nb09.close_float, nb09.GRAD_NORM_WRONG),
    Hidden("check_fully_shard_plan", NB09, ("fully_shard_plan",), NB09_PREAMBLE, TIMEOUT_S,
           nb09.fully_shard_plan_cases, nb09.plan_equal, nb09.PLAN_WRONG),
)

HIDDEN: dict[str, Hidden] = {h.check: h for h in _ENTRIES}
