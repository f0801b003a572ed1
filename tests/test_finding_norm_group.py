"""Why a norm gets its own fully_shard call (issue 48, part 4, finding 5).

A `MixedPrecisionPolicy` belongs to one `fully_shard` call, so a module whose *parameters* must
stay fp32 (`param_dtype=torch.float32`) needs a group of its own. Computing a norm in fp32
needs none: its forward can upcast, and torch's norm kernels accumulate bf16 inputs in fp32
(measured here: `F.rms_norm` on bf16 equals the fp32 computation rounded once). torchtitan's
`apply_fsdp` wraps no norm apart (its blocks' norms shard with their block, the final norm
with the output layer). Notebook 09 must not say a separate call is needed to compute in fp32.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from finding_text import markdown, sentences


def norm_sentences() -> list[str]:
    return [s for s in sentences(markdown("09")) if re.search(r"\bnorm\b", s)
            and re.search(r"own (?:call|group|fully_shard)|one more group|no group", s)]


def test_rms_norm_computes_bf16_inputs_in_fp32():
    torch.manual_seed(0)
    x, w = torch.randn(64, 4096) * 3 + 1, torch.randn(4096)
    bf16 = F.rms_norm(x.bfloat16(), (4096,), w.bfloat16())
    once = F.rms_norm(x.bfloat16().float(), (4096,), w.bfloat16().float()).bfloat16()
    assert torch.equal(bf16, once)


def test_notebook_09_ties_the_norm_group_to_fp32_parameters_not_fp32_compute():
    said = " ".join(norm_sentences())
    assert said, "notebook 09 no longer says when a norm needs its own fully_shard call"
    assert not re.search(r"must compute in fp32[^.]*needs its own", said), said
    assert re.search(r"parameters must stay fp32|keep its parameters in fp32", said), said
    assert re.search(r"torchtitan", said), said
