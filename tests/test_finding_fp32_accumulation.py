"""The gradient FSDP2 holds between micro-batches with reduce_dtype=float32 (issue 48, part 4,
finding 4).

Under `set_requires_gradient_sync(False)`, FSDP2 with `MixedPrecisionPolicy(param_dtype=
torch.bfloat16, reduce_dtype=torch.float32)` converts each backward's unsharded bf16 gradient
to an fp32 accumulator (torch 2.13 _fsdp_param.py `to_accumulated_grad_if_needed`, called by
_fsdp_param_group.py `post_backward` when it does not reduce): 4 bytes a parameter on every
rank between micro-batches, twice the 2 bytes of a bf16 gradient (stage 1's gradient memory in
the paper's mixed precision). Measured on 2 gloo ranks (tests/workers/finding_cases.py).
Notebooks 08 and 09 must say it where they say FSDP2 holds the full gradient.
"""

from __future__ import annotations

import re

import pytest
from common import finding_reports
from finding_text import markdown, sentences


@pytest.fixture(scope="module")
def reports() -> tuple[dict, ...]:
    return finding_reports("held_gradient")


def test_fsdp2_holds_the_unsharded_gradient_in_fp32_with_reduce_dtype_fp32(reports):
    for rep in reports:
        psi = rep["psi"]
        assert rep["fp32"] == {"bytes": 4 * psi, "dtypes": ["torch.float32"]}
        assert rep["none"] == {"bytes": 2 * psi, "dtypes": ["torch.bfloat16"]}


def held(prefix: str) -> str:
    """The sentences that say what FSDP2 holds while the micro-batches run."""
    return " ".join(s for s in sentences(markdown(prefix))
                    if re.search(r"set_requires_gradient_sync\(False\)", s)
                    and re.search(r"\bholds?\b|\bkept\b|\bkeeps\b", s))


@pytest.mark.parametrize("prefix", ["08", "09"])
def test_the_notebooks_say_the_held_gradient_is_fp32_with_reduce_dtype(prefix):
    said = held(prefix)
    assert said, f"notebook {prefix} no longer says what FSDP2 holds under no sync"
    assert re.search(r"reduce_dtype", said), said
    assert re.search(r"4 bytes a parameter", said), said
