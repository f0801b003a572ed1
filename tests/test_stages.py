"""zero_lab.stages: shard() for stages 0-2 checked against one process on the global batch.

Every multi-rank number comes from tests/workers/stage_cases.py, run in one launch per world
size N = 1, 2, 3 that it shares with the other case workers (tests/common.py); it trains 23
configurations for 10 steps each: stages 0, 1, 2, stage 1's all-reduce variant and the
standalone ZeroRedundancyOptimizer; odd-sized MLPs with and without biases, a nested model
(LayerNorm, a 0-d parameter, a frozen layer, a layer used twice), a small GPT with a tied head;
Adam, AdamW, SGD with momentum; gradient accumulation, clipping, tiny buckets, mixed precision;
on gloo the direct exchange (zero_lab.collectives.exchange) and, for three cases, torch's
collectives.
Ranks initialise differently, so every case also checks that shard() starts them from
rank 0's weights.
"""

from __future__ import annotations

import pytest
import torch
from common import (
    WORLD_SIZES,
    assert_every_rank_ran_every_case,
    assert_global_clip_norms,
    assert_losses_match_the_global_batch,
    select_cases,
    stage_case_reports,
)

from zero_lab import memory
from zero_lab.course import workloads as W
from zero_lab.measure.memory import held_bytes
from zero_lab.stages import shard
from zero_lab.stages.mixed_precision import mixed_precision_reference

FP32_ATOL = 1e-6  # fp32 weights of size ~0.1-1 after 10 steps; measured worst 1.2e-7
N_CASES = 23


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"N={n}")
def ranks(request) -> tuple[int, tuple[dict, ...]]:
    n = request.param
    return n, stage_case_reports(n)




# ------------------------------------------------------------------ equivalence


def test_every_rank_ran_every_case(ranks):
    n, reports = ranks
    assert_every_rank_ran_every_case(reports, n, N_CASES)


def test_fp32_training_matches_one_process_on_the_global_batch(ranks):
    n, reports = ranks
    for c in select_cases(reports, precision="fp32"):
        assert c["keys_match"], c["name"]
        assert c["ref_moved"] > 1e-2, f"{c['name']}: the reference barely trained"
        assert c["max_abs_diff"] <= FP32_ATOL, (c["name"], c["worst_key"], c["max_abs_diff"])


def test_groups_send_by_direct_exchange_on_gloo_unless_told_otherwise(ranks):
    """On gloo, `transport="auto"` picks zero_lab.collectives.exchange; `shard(...,
    transport="torch")` (three cases) keeps torch's collectives, which train to the same
    result."""
    n, reports = ranks
    transports = {c["transport"] for c in reports[0]["cases"]}
    assert transports == {"auto", "torch"}
    for c in reports[0]["cases"]:
        assert c["direct"] and set(c["direct"]) == {c["transport"] == "auto"}, c["name"]


def test_full_state_dict_is_identical_on_every_rank(ranks):
    n, reports = ranks
    for i, c in enumerate(reports[0]["cases"]):
        assert {rep["cases"][i]["digest"] for rep in reports} == {c["digest"]}, c["name"]


def test_losses_averaged_over_ranks_match_the_global_batch_loss(ranks):
    n, reports = ranks
    assert_losses_match_the_global_batch(reports)


def test_clip_grad_norm_returns_the_global_norm_and_clips(ranks):
    n, reports = ranks
    assert assert_global_clip_norms(reports, clip_of=lambda c: c["clip"]) >= 6


def test_mixed_precision_matches_its_single_process_reference(ranks):
    """N = 1: bit for bit (same recipe, no sharding). N > 1: the bf16 gradients of each rank's
    slice of the batch round differently from those of the whole batch, so the weights drift
    apart at bf16 level; the drift must stay within what mixed precision itself causes
    (fp32 reference vs mixed reference)."""
    n, reports = ranks
    mixed = select_cases(reports, precision="mixed")
    assert len(mixed) == 5
    for c in mixed:
        assert c["keys_match"], c["name"]
        if n == 1:
            assert c["max_abs_diff"] == 0.0, c["name"]
        else:
            assert 0 < c["precision_gap"] < 0.1, c["name"]
            assert c["max_abs_diff"] <= 2 * c["precision_gap"], (c["name"], c["max_abs_diff"],
                                                                 c["precision_gap"])


def test_gradients_are_final_when_backward_returns(ranks):
    """Two backward calls accumulate; right after, each rank's gradient of what it updates
    equals the one-process gradient; opt.zero_grad() and model.zero_grad() both clear it."""
    n, reports = ranks
    for rep in reports:
        for g in rep["grads_after_backward"]:
            assert g["max_error"] <= 1e-6, g
            assert g["after_zero_grad"] == 0.0, g
            # stage 2 keeps no full gradient: every param.grad is gone after backward
            assert g["model_grads_none"] == (g["stage"] == 2), g


# ------------------------------------------------------------------ memory and bytes


def _states(c: dict) -> str:
    return c["optimizer"]


def test_held_bytes_after_backward_match_the_memory_model(ranks):
    """Per rank, after backward: exactly what the flat layout implies, and the ZeRO formula
    (zero_lab.memory.model_state_bytes, fp32 or mixed) up to the padding of each group."""
    n, reports = ranks
    for rep in reports:
        for c in rep["cases"]:
            stage = 1 if c["standalone"] else c["stage"]
            per_elem = memory.bytes_per_param(c["precision"], _states(c))
            padded, shard_ = c["padded_numel"], c["shard_numel"]
            held = c["held_after_backward"]
            assert held["params"] == per_elem["params"] * padded + 4 * c["n_frozen"], c["name"]
            assert held["grads"] == per_elem["grads"] * (shard_ if stage == 2 else padded)
            # fp32 masters of the whole buffer or slice (mixed precision), optimizer states
            # for the real elements stepped, no padding
            masters = 4 * (padded if stage == 0 else shard_) if c["precision"] == "mixed" else 0
            states = (per_elem["optimizer"] - (4 if masters else 0)) * c["stepped_numel"]
            assert held["optimizer"] == masters + states, c["name"]
            if c["n_frozen"]:
                continue  # the formula counts trainable parameters only
            predicted = memory.model_state_bytes(c["n_trainable"], stage, n, c["precision"],
                                                 _states(c), pad_to=1)
            # each group pads to a multiple of N: at most N elements per group and state, more
            # in the buffers; the optimizer's state covers no padding, so the last rank may
            # hold up to as much less
            slack = {k: per_elem[k] * c["n_groups"] * n for k in ("params", "grads", "optimizer")}
            for key in ("params", "grads"):
                assert 0 <= held[key] - predicted[key] <= slack[key], (c["name"], key)
            assert abs(held["optimizer"] - predicted["optimizer"]) <= slack["optimizer"]
            if c["n_groups"] == 1 and stage > 0:  # one flat buffer: the formula, exactly,
                # less the states the padding of this rank's slice does not need
                unneeded = (per_elem["optimizer"] - (4 if masters else 0)) * (
                    shard_ - c["stepped_numel"])
                assert held == {**predicted, "optimizer": predicted["optimizer"] - unneeded,
                                "total": predicted["total"] - unneeded}, c["name"]


def test_sharded_stages_hold_less_than_stage_0(ranks):
    n, reports = ranks
    same = select_cases(reports, model="mlp_odd", optimizer="adam", variant="reduce_scatter",
                  standalone=False, precision="fp32")
    by_stage = {c["stage"]: c["held_after_backward"] for c in same if c["n_groups"] == 1}
    if n == 1:
        assert by_stage[0] == by_stage[1] == by_stage[2]
    else:
        assert by_stage[1]["optimizer"] < by_stage[0]["optimizer"]
        assert by_stage[2]["grads"] < by_stage[1]["grads"] == by_stage[0]["grads"]
        assert by_stage[2]["total"] < by_stage[1]["total"] < by_stage[0]["total"]


def test_bytes_communicated_per_step(ranks):
    """The ledger's ZeRO-paper volume of one step: 2Ψ for stages 0, 1, 2 (an all-reduce counts
    twice) and 3Ψ for stage 1's all-reduce variant; Ψ of the padded flat buffers, in bytes."""
    n, reports = ranks
    for c in reports[0]["cases"]:
        psi_bytes = c["element_size"] * c["padded_numel"]
        ops = set(c["ledger"])
        if c["variant"] == "all_reduce":
            assert ops == {"all_reduce", "all_gather"}, c["name"]
            assert c["ledger_volume"] == 3 * psi_bytes, c["name"]
        else:
            assert c["ledger_volume"] == 2 * psi_bytes, c["name"]
            expected_ops = {"all_reduce"} if c["stage"] == 0 and not c["standalone"] else {
                "reduce_scatter", "all_gather"}
            assert ops == expected_ops, c["name"]
        for op, summary in c["ledger"].items():  # one collective per group, no broadcasts
            assert summary["count"] == c["n_groups"], (c["name"], op)
        # against the paper's 2Ψ on the unpadded parameters: padding is < N per group
        paper = (3 if c["variant"] == "all_reduce" else 2) * c["element_size"] * c["n_trainable"]
        assert 0 <= c["ledger_volume"] - paper <= 3 * c["element_size"] * c["n_groups"] * n


def test_gradient_collectives_overlap_backward(ranks):
    """Stage 0's all-reduces and stage 2's reduce-scatters start inside backward, async."""
    n, reports = ranks
    for c in reports[0]["cases"]:
        if c["standalone"]:
            assert c["ledger_in_backward"] == []  # step() reduce-scatters: no hooks
            continue
        grad_op = ("reduce_scatter" if c["stage"] > 0 and c["variant"] == "reduce_scatter"
                   else "all_reduce")
        assert grad_op in c["ledger_in_backward"], c["name"]
        assert grad_op in c["ledger_async"], c["name"]


def test_no_warnings(ranks):
    n, reports = ranks
    for rep in reports:
        assert rep["warnings"] == []


# ------------------------------------------------------------------ refusals


NESTED = ("shard() the outer model once, built from modules no shard() call has changed "
          "(shard() moved that part's parameters into its own flat buffers and hooks)")
REFUSALS = {
    "stage5": "ValueError: stage must be one of the ints (0, 1, 2, 3), got 5",
    "stage_float": "ValueError: stage must be one of the ints (0, 1, 2, 3), got 1.0",
    "stage_bool": "ValueError: stage must be one of the ints (0, 1, 2, 3), got True",
    "bucket_nan": "ValueError: bucket_mb must be a positive number of megabytes, got nan",
    "bucket_inf": "ValueError: bucket_mb must be a positive number of megabytes, got inf",
    "max_norm": "ValueError: 0 is an Embedding with max_norm=1.0: it renormalises rows of its "
                "weight in place during forward, outside the optimizer, which a sharded weight "
                "cannot follow (stage 3 holds a gathered copy, stages 1-2 would not all-gather "
                "the change); use max_norm=None",
    "empty_param": "ValueError: parameter nothing has no elements (shape (0,)); freeze it "
                   "(requires_grad=False) or remove it before shard()",
    "meta": "ValueError: parameter 0.weight is on the meta device (no data yet): materialise "
            "the model first (model.to_empty(device=...) and initialise it), then shard() it",
    "zero_redundancy_empty": "ValueError: ZeroRedundancyOptimizer got no parameter that "
                             "requires grad (0 parameter(s) given)",
    **{f"outside_optimizer_{s}": f"RuntimeError: this SGD steps parameters of a model sharded "
       f"at stage {s}, whose gradients live in the optimizer shard() returned (each rank's "
       "slice): it would train wrong. Use the optimizer shard() returns, built with "
       "shard(model, stage, optimizer=lambda params: torch.optim.SGD(params, ...))"
       for s in (1, 2)},
    "precision": "ValueError: precision must be one of ('fp32', 'mixed', 'bf16', 'fp16'), got "
                 "'fp8'",
    "bucket": "ValueError: bucket_mb must be a positive number of megabytes, got 0",
    "variant": "ValueError: zero1_variant applies to stage 1 only, not stage 2",
    "unit_classes": "ValueError: unit_classes applies to stage 3 only, not stage 1",
    "batchnorm": "RuntimeError: 1 is a BatchNorm1d in training mode: it normalises by the "
                 "statistics of each rank's local batch, so training would not match one "
                 "process on the global batch. Fine-tuning with pretrained statistics: keep it "
                 "in eval mode (call 1.eval() after every model.train()), which is exact. "
                 "Training it: use nn.GroupNorm or nn.LayerNorm, which work on CPU (gloo) and "
                 "GPU; nn.SyncBatchNorm works only on CUDA with NCCL",
    "sparse": "ValueError: 0 produces sparse gradients (sparse=True), which flat gradient "
              "buffers cannot hold; use sparse=False",
    "frozen": "ValueError: the model has no trainable parameters (all requires_grad=False)",
    "float64": "ValueError: parameter 0.weight is torch.float64; shard() takes a float32 model "
               "(precision='mixed' makes the bf16 copies itself)",
    "shared_storage": "ValueError: parameters 0.weight and 2.weight are different Parameter "
                      "objects sharing memory; tie weights by assigning the same nn.Parameter "
                      "to both modules",
    "twice": "ValueError: this model is already sharded; shard() a fresh model",
    **{f"nested_{i}_in_{o}": f"ValueError: model.1 is already sharded (stage {i}): {NESTED}"
       for i in range(4) for o in range(4)},
    "nested_deep": f"ValueError: model.1.1 is already sharded (stage 2): {NESTED}",
    "lbfgs": "ValueError: LBFGS is not supported: zero_lab shards optimizer state by flat "
             "slice, which is exact only for element-wise optimizers (SGD, Adam, AdamW, "
             "Adamax, NAdam, RAdam, Adagrad, Adadelta, RMSprop, Rprop, ASGD)",
    "stranger": "ValueError: the optimizer function put 2 tensor(s) that are not parameters of "
                "the model being sharded into the optimizer (shape (5, 5)); build it on the "
                "parameters it is given",
    "instance": "TypeError: optimizer must be a function that builds the optimizer, not an "
                "optimizer: pass e.g. lambda params: torch.optim.Adam(params, lr=...) (shard() "
                "calls it on the model's parameters, then builds the same optimizer on this "
                "rank's slices)",
    "not_optimizer": "TypeError: optimizer must be a function of a parameter list returning a "
                     "torch.optim.Optimizer, e.g. lambda params: torch.optim.Adam(params, "
                     "lr=1e-3); it returned NoneType",
    "uneven_batch": "ValueError: global batch of 5 rows does not split evenly over 2 ranks; "
                    "use a multiple of 2",
}


def test_shard_refuses_what_would_train_wrong_with_a_clear_message():
    reports = stage_case_reports(2)
    for rep in reports:
        assert rep["errors"] == REFUSALS


def test_shard_needs_a_process_group():
    with pytest.raises(RuntimeError, match=r"shard\(\) needs torch.distributed initialised"):
        shard(W.deep_mlp(4, 1), 1)


@pytest.mark.parametrize("flag", ["find_unused_parameters", "broadcast_buffers", "check_lockstep",
                                  "check_order", "overlap_param_gather", "overlap_grad_reduce",
                                  "overlap_step"])
def test_a_flag_that_is_not_a_bool_is_refused_by_name_first(flag):
    for value in (1, "yes"):
        with pytest.raises(TypeError, match=f"^{flag} must be True or False, got {value!r}$"):
            shard(W.deep_mlp(4, 1), 1, **{flag: value})


# ------------------------------------------------------------------ workloads, one process


def test_deep_mlp_is_the_blogs_model_scaled():
    model = W.deep_mlp(d=8, depth=6)
    assert [type(m).__name__ for m in model][:2] == ["Linear", "ReLU"] and len(model) == 12
    assert W.count_parameters(model) == 6 * (8 * 8 + 8)
    assert W.count_parameters(W.deep_mlp(8, 3, bias=False)) == 3 * 64


def test_tiny_gpt_ties_its_head_to_the_token_embedding():
    gpt = W.TinyGPT(vocab_size=11, seq_len=5, d_model=8, n_heads=2, n_layers=1)
    assert gpt.head.weight is gpt.tok_emb.weight
    names = [n for n, _ in gpt.named_parameters(remove_duplicate=False)]
    assert "head.weight" in names and "tok_emb.weight" in names
    assert W.count_parameters(gpt) == sum(p.numel() for p in set(gpt.parameters()))
    logits = gpt(W.gpt_batch(0, 3, 5, 11)[0])
    assert logits.shape == (3, 5, 11)


def test_rank_slices_make_up_the_global_batch():
    batch = W.mlp_batch(3, 12, 4)
    for n in (1, 2, 3, 4):
        parts = [W.rank_slice(batch, r, n) for r in range(n)]
        for i in range(2):
            assert torch.equal(torch.cat([p[i] for p in parts]), batch[i])
    assert torch.equal(W.mlp_batch(3, 12, 4)[0], batch[0])  # same step, same numbers
    assert not torch.equal(W.mlp_batch(4, 12, 4)[0], batch[0])


def test_mixed_precision_reference_keeps_fp32_masters():
    torch.manual_seed(0)
    model = W.deep_mlp(6, 2)
    original = [p.detach().clone() for p in model.parameters()]
    model, opt = mixed_precision_reference(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(m, o) for m, o in zip(opt.master_weights, original, strict=True))
    out = model(torch.randn(3, 6))
    assert out.dtype == torch.float32  # outputs come back in fp32, so the loss is fp32
    out.square().mean().backward()
    opt.step()
    for p, m in zip(model.parameters(), opt.master_weights, strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))  # bf16 weights are the rounded masters
    held = held_bytes(model, opt)
    n = W.count_parameters(model)
    assert held["params"] == held["grads"] == 2 * n
    assert held["optimizer"] == 12 * n  # fp32 master + Adam m and v
