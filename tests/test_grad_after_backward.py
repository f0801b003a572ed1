"""What a user reads after `loss.backward()` is the averaged gradient the step uses (torch's
contract, as with DDP and FSDP2: clipping, logging and hooks read `.grad`), at stages 0-3
under every precision policy; and shard() refuses a model torch already wrapped for data
parallelism (issue 47, items 10 and 11).

tests/workers/grad_after_backward.py, in the launch of world_cases.py on 2 gloo ranks:
CS336's FSDP toy (an embedding, RMSNorms of its own, Linears; stage 3 cut as CS336's FSDP
cuts it, the norms
left to the root), fp32, bf16 and fp16, norms kept in fp32 or not, reduce_dtype=float32 or
not, one backward and two, stage 3 with root_params "shard" and "replicate": 90 cases.
"""

from __future__ import annotations

import pytest
from common import case_reports

NPROC = 2
PARAMS = ["embedding.weight", "norm1.weight", "linear1.weight", "norm2.weight",
          "linear2.weight", "lm_head.weight"]
ROOT_PARAMS = ["norm1.weight", "norm2.weight"]  # no unit class (Linear, Embedding) claims them
SHAPES = {"norm1.weight": [9], "norm2.weight": [13]}


@pytest.fixture(scope="module")
def reports() -> tuple[dict, ...]:
    return case_reports("grad_after_backward", NPROC)


def held_whole(case: dict) -> list[str]:
    """The parameters a rank holds whole, by stage: every one at stage 0 (DDP), none at
    stages 1-2 (each rank's gradient is its slice) nor at stage 3 sharding its root; the
    root's parameters at stage 3 with root_params="replicate", whatever the precision
    policy (FSDP2's replicate() beside fully_shard, CS336's replicated norms)."""
    if case["stage"] == 0:
        return PARAMS
    if case["root_params"] == "replicate":
        return ROOT_PARAMS
    return []


def check_averaged(case: dict) -> None:
    """Every gradient the rank holds whole is the average of the ranks' local gradients,
    and so is the (slice of the) gradient the step uses, to the tolerance of the dtype the
    local gradients were computed in."""
    for name, seen in case["whole"].items():
        assert seen["diff"] <= seen["tol"], (case["name"], name, seen)
    for group in case["step"]:
        assert group["diff"] <= group["tol"], (case["name"], group)


def check_same_on_every_rank(cases: list[dict]) -> None:
    """The ranks' `.grad`s of a parameter held whole are identical, bit for bit: one
    averaged gradient, not each rank's own."""
    first = cases[0]
    for other in cases[1:]:
        for name, grad in first["grads"].items():
            worst = max(abs(a - b) for a, b in zip(grad, other["grads"][name], strict=True))
            assert worst == 0, f"{first['name']}: {name}'s .grad differs between ranks by {worst}"


def test_grad_after_backward_is_the_average_the_step_uses(reports):
    names = [c["name"] for c in reports[0]["grads"]]
    assert len(names) == len(set(names)) == 90  # (3 stages + 2 roots) x 9 policies x 2
    for rep in reports:
        assert [c["name"] for c in rep["grads"]] == names
        for case in rep["grads"]:
            check_averaged(case)
            assert sorted(case["whole"]) == sorted(held_whole(case)), case["name"]
    for i in range(len(names)):
        check_same_on_every_rank([rep["grads"][i] for rep in reports])


def test_cs336_norms_kept_fp32_are_replicated_whole_at_the_root(reports):
    """CS336's test_fsdp_gradient_sync[fp16] through a thin adapter: stage 3, fp16, the
    RMSNorms kept in fp32, reduce_dtype=float32, root_params="replicate": the norms are
    whole (their full shape) in fp32 on every rank, and their `.grad` the same average
    everywhere."""
    name = "stage 3 fp16+keep_norms+reduce_fp32 x1 root=replicate"
    cases = [next(c for c in rep["grads"] if c["name"] == name) for rep in reports]
    for case in cases:
        assert sorted(case["whole"]) == ROOT_PARAMS
        for param in ROOT_PARAMS:
            assert case["whole"][param]["shape"] == SHAPES[param]
            assert case["whole"][param]["dtype"] == "torch.float32"
        check_averaged(case)
    check_same_on_every_rank(cases)


def test_the_checks_fail_their_mutants(reports):
    case = next(c for c in reports[0]["grads"] if c["stage"] == 0)
    # a rank's `.grad` off the average by more than the dtype's rounding
    name = PARAMS[0]
    bad = {**case, "whole": {name: {**case["whole"][name], "diff": 2 * case["whole"][name]["tol"]}}}
    with pytest.raises(AssertionError, match=name):
        check_averaged(bad)
    # one rank's gradient differing from the other's in the last element
    other = {**case, "grads": {n: g[:-1] + [g[-1] + 1e-3] for n, g in case["grads"].items()}}
    with pytest.raises(AssertionError, match="differs between ranks"):
        check_same_on_every_rank([case, other])


WRAPPED = {
    "ddp": "ValueError: model is torch's DistributedDataParallel (DDP), which averages the "
           "gradients itself: with shard()'s own reduction as well, both would handle every "
           "gradient. shard() does data parallelism itself (stage 0 is DDP's all-reduce): "
           "pass the module DDP wraps, shard(ddp.module, stage)",
    "ddp_inside": "ValueError: model.1 is torch's DistributedDataParallel (DDP), which "
                  "averages the gradients itself: with shard()'s own reduction as well, both "
                  "would handle every gradient. shard() does data parallelism itself (stage 0 "
                  "is DDP's all-reduce): pass the module DDP wraps, shard(ddp.module, stage)",
    "fsdp1": "ValueError: model is torch's FullyShardedDataParallel (FSDP1), which has "
             "flattened and sharded its parameters already. shard() does the sharding itself "
             "(stage 3 is FSDP's): build the model again without FSDP and pass it to shard()",
    "fsdp2": "ValueError: model was sharded by torch's fully_shard (FSDP2): its parameters "
             "are DTensors, sharded already. shard() does the sharding itself (stage 3 is "
             "FSDP's): build the model again without fully_shard and pass it to shard()",
    "fsdp2_inside": "ValueError: model.1 was sharded by torch's fully_shard (FSDP2): its "
                    "parameters are DTensors, sharded already. shard() does the sharding "
                    "itself (stage 3 is FSDP's): build the model again without fully_shard "
                    "and pass it to shard()",
}


def test_shard_refuses_a_model_torch_already_wrapped(reports):
    for rep in reports:
        assert rep["wrapped"] == WRAPPED
