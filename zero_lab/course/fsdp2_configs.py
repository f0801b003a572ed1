"""What notebook 09's launches run, shared by the rank script (zero_lab/workers/fsdp2_practice.py)
and the checks of what it measured (zero_lab/grading/nb09_fsdp2_runs.py): the model (the course
GPT) and the FSDP2 configurations whose collectives are counted."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from zero_lab.course import models

MODEL = models.GPT  # the course GPT (zero_lab/course/models.py); read, never changed
GLOBAL_BATCH = 12  # splits evenly over 1, 2, 3 and 4 ranks
STEPS, SAVE_AT = 4, 2  # optimizer steps; the DCP checkpoint is saved after SAVE_AT of them
LR = 1e-3
# name -> the keywords of every fully_shard call
CONFIGS = {
    "default": {},
    "reshard_after_forward=True": {"reshard_after_forward": True},
    "reshard_after_forward=False": {"reshard_after_forward": False},
    "reshard_after_forward=1": {"reshard_after_forward": 1},  # to groups of 1 rank: = False
    "bf16 params, fp32 reduce": {"mp_policy": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
    # every LayerNorm its own fully_shard call in fp32, handing bf16 on to the next Linear
    "bf16, norms in fp32": {"mp_policy": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32), "norm_policy":
        MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.bfloat16)},
}
ACCUMULATION_K = 2  # micro-batches of the accumulation run (default configuration)
