"""zero_lab.memory: exact byte counts, published values, error messages, properties."""

from __future__ import annotations

import inspect
import math
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_lab import memory

GB = 10**9
GiB = 2**30


# ------------------------------------------------------------------- bytes per param


@pytest.mark.parametrize(
    "precision, optimizer, params, grads, k",
    [
        ("mixed", "adam", 2, 2, 12),  # ZeRO paper section 3.1: 2 + 2 + K, K = 12
        ("mixed", "adamw", 2, 2, 12),
        ("mixed", "sgd_momentum", 2, 2, 8),  # master + momentum
        ("mixed", "sgd", 2, 2, 4),  # master copy only
        ("fp32", "adam", 4, 4, 8),
        ("fp32", "sgd_momentum", 4, 4, 4),
        ("fp32", "sgd", 4, 4, 0),
    ],
)
def test_bytes_per_param_recipes(precision, optimizer, params, grads, k):
    b = memory.bytes_per_param(precision, optimizer)
    assert (b["params"], b["grads"], b["optimizer"]) == (params, grads, k)
    assert b["optimizer"] == b["master"] + b["optimizer_states"]
    assert b["total"] == params + grads + k


def test_sixteen_bytes_both_ways_with_different_split():
    mixed, fp32 = memory.bytes_per_param("mixed", "adam"), memory.bytes_per_param("fp32", "adam")
    assert mixed["total"] == fp32["total"] == 16
    assert (mixed["master"], fp32["master"]) == (4, 0)


def test_memory_imports_without_torch():
    code = "import sys, zero_lab.memory; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------- per-rank states


def test_figure1_exact_bytes_and_published_rounding():
    # Ψ = 7.5e9, N_d = 64 divides evenly: 117,187,500 elements per rank.
    psi, n = 7_500_000_000, 64
    exact = {0: 16 * psi, 1: 4 * psi + 12 * psi // n, 2: 2 * psi + 14 * psi // n, 3: 16 * psi // n}
    assert memory.paper_figure1() == exact
    published_gb = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}  # Figure 1, GB = 1e9 bytes
    for stage, gb in published_gb.items():
        assert round(exact[stage] / GB, 1) == gb
    # In GiB the same bytes read smaller: 120 GB is 111.8 GiB.
    assert round(exact[0] / GiB, 1) == 111.8


def _matches_printed(computed: float, published: float) -> bool:
    """The paper rounds some entries and truncates others (41.25 -> 41.3, 257.75 -> 257)."""
    text = repr(published)
    decimals = len(text.split(".")[1]) if "." in text else 0
    unit = 10.0**-decimals
    return -unit / 2 <= computed - published < unit


def test_paper_table1_matches_published_values():
    computed = memory.paper_table1()
    assert set(computed) == {7.5e9, 128e9, 1e12}
    for psi, by_stage in memory.PAPER_TABLE_1.items():
        for stage, published in by_stage.items():
            for value, printed in zip(computed[psi][stage], published, strict=True):
                assert _matches_printed(value / GB, printed), (psi, stage, value, printed)
    # spot checks straight from the formulas
    assert computed[7.5e9][1][1] == 52_500_000_000  # 4Ψ + 12Ψ/4
    assert computed[1e12][3][-1] == 15_625_000_000  # 16Ψ/1024: the paper's 1T headline


def test_paper_table2_matches_published_values():
    table = memory.paper_table2()
    base = table[1]
    for stage in memory.STAGES:  # MP = 1 rounds to the printed values
        printed = memory.parse_count(memory.PAPER_TABLE_2[1][stage])
        assert round(base[stage] / 1e9, 1) == printed / 1e9
    assert base[3] == 128 * 10**9  # 32 GB / (16 bytes / 64)
    for mp, row in memory.PAPER_TABLE_2.items():
        assert memory.parse_count(row[0]) == table[mp][0]  # baseline: exact
        # stages 1-2: the paper scales its rounded MP = 1 value (7.6B) by MP
        for stage in (1, 2):
            printed = memory.parse_count(row[stage])
            assert math.isclose(printed, mp * round(base[stage] / 1e9, 1) * 1e9, rel_tol=1e-9)
            assert table[mp][stage] > printed  # so the unrounded value is a bit larger
        # stage 3 prints 0.5T / 1T / 2T for 512B / 1024B / 2048B
        printed3 = memory.parse_count(row[3])
        assert abs(table[mp][3] - printed3) / printed3 < 0.05
    # the measured ZeRO-OS sizes sit below the theoretical maximum of model states
    for mp, row in memory.PAPER_TABLE_2.items():
        assert memory.parse_count(row["measured_zero1"]) < table[mp][1]


def test_table2_uses_gb_not_gib():
    assert round(memory.largest_model(32 * GB, 64, 1) / 1e9, 1) == 7.6
    assert round(memory.largest_model(32 * GiB, 64, 1) / 1e9, 1) == 8.2  # not the paper's


def test_uneven_partition_rounds_up():
    # Ψ = 10 over 4 ranks: each owns ceil(10/4) = 3 elements (the last one 1 padding + 2 real).
    s3 = memory.model_state_bytes(10, 3, 4)
    assert s3 == {"params": 6, "grads": 6, "optimizer": 36, "total": 48}
    s1 = memory.model_state_bytes(10, 1, 4)
    assert s1 == {"params": 20, "grads": 20, "optimizer": 36, "total": 76}


def test_pad_to_counts_the_padded_flat_buffer():
    # pad_to=1: the course's partition.py (flat buffer padded to a multiple of N)
    assert memory.partition_elements(10, 3, pad_to=1) == 4
    assert memory.model_state_bytes(10, 1, 3, "fp32", "adam", pad_to=1) == {
        "params": 4 * 12, "grads": 4 * 12, "optimizer": 8 * 4, "total": 128,
    }
    # pad_to=2: DeepSpeed ZeRO-1/2 aligns each slice to 2 elements
    assert memory.partition_elements(5, 2, pad_to=2) == 4
    assert memory.model_state_bytes(5, 2, 2, pad_to=2) == {
        "params": 2 * 8, "grads": 2 * 4, "optimizer": 12 * 4, "total": 72,
    }
    # stage 0 has no flat partition: padding does not apply
    assert memory.model_state_bytes(5, 0, 2, pad_to=2) == memory.model_state_bytes(5, 0, 2)


def test_largest_model_is_exact():
    for gpu, n, stage in [(32 * GB, 64, 1), (80 * GiB, 8, 2), (1000, 3, 3), (24 * GiB, 1, 0)]:
        best = memory.largest_model(gpu, n, stage)
        assert memory.model_state_bytes(best, stage, n)["total"] <= gpu
        assert memory.model_state_bytes(best + 1, stage, n)["total"] > gpu
    assert memory.largest_model(10, 1, 0) == 0  # not even one parameter fits


# ---------------------------------------------------------------------- bad input

BAD_N_PARAMS = [0, -5, 1.5, float("nan"), float("inf"), True, "7B", None]


@pytest.mark.parametrize("bad", BAD_N_PARAMS)
def test_bad_n_params(bad):
    with pytest.raises(ValueError, match=r"n_params must be a positive whole"):
        memory.model_state_bytes(bad, 1, 2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1"):
        memory.model_state_bytes(100, 1, bad)


@pytest.mark.parametrize("bad", [-1, 4, 1.5, "1", None])
def test_bad_stage(bad):
    with pytest.raises(ValueError, match=r"stage must be one of 0, 1, 2, 3; got"):
        memory.model_state_bytes(100, bad, 2)


def test_bad_precision_and_optimizer_name_accepted_values():
    with pytest.raises(ValueError, match=r"precision must be one of 'fp32', 'mixed', 'bf16', "
                                         r"'fp16'; got 'fp8'"):
        memory.bytes_per_param("fp8", "adam")
    with pytest.raises(ValueError, match=r"optimizer must be one of 'adam', 'adamw', "
                                         r"'sgd_momentum', 'sgd'; got 'lamb'"):
        memory.model_state_bytes(100, 1, 2, optimizer="lamb")


@pytest.mark.parametrize("bad", [0, -1e9, float("nan"), float("inf")])
def test_bad_gpu_bytes(bad):
    with pytest.raises(ValueError, match=r"gpu_bytes must be a finite positive number"):
        memory.largest_model(bad, 8, 3)


def test_bad_pad_to():
    with pytest.raises(ValueError, match=r"pad_to must be None or an int >= 1"):
        memory.model_state_bytes(100, 1, 2, pad_to=0)


# Each argument's domain, as values it must refuse. Counts of parameters, layers, tokens
# accept integral floats (7.5e9); rank counts, stages and pad_to are ints: not bools, not 1.0.
NAN, INF = float("nan"), float("inf")
COUNT = [0, -5, 2.5, NAN, INF, True, "2", None]
COUNT_OR_ZERO = [-1, 2.5, NAN, True, "2", None]
COUNT_OR_NONE = [0, -1, 2.5, True, "2"]  # None means "not set"
INT = [0, -1, 2.0, True, "2", None]
INT_OR_NONE = [0, 2.0, True, "2"]
STAGE = [-1, 4, 1.0, True, "1", None]
POSITIVE = [0, -1.0, NAN, INF, True, "80e9", None]  # byte budgets, safety factors
FLAG = [0, 1, "False", None]
RECIPE = {"precision": ["fp8", "FP32", 1, None], "optimizer": ["lamb", 1, None],
          "grad_bytes": [0, 3, 8, 2.0, 4.0, True, "4"]}  # None: the precision's own
SHAPE = {"seq_len": COUNT, "batch": COUNT, "hidden": COUNT, "heads": COUNT}
ATTENTION = ["flash", "Fused", True, None]
LAYER = {"seq_len": 2048, "batch": 2, "hidden": 4096, "heads": 32}

PUBLIC_API = {  # name: (a call that works, {argument: values that must be refused})
    "bytes_per_param": ({}, RECIPE),
    "partition_elements": (
        {"n_params": 10, "world_size": 3},
        {"n_params": COUNT, "world_size": INT, "pad_to": INT_OR_NONE},
    ),
    "model_state_bytes": (
        {"n_params": 7.5e9, "stage": 1, "world_size": 8},
        {"n_params": COUNT, "stage": STAGE, "world_size": INT, "pad_to": INT_OR_NONE, **RECIPE},
    ),
    "largest_model": (
        {"gpu_bytes": 80 * GiB, "world_size": 8, "stage": 3},
        {"gpu_bytes": POSITIVE, "world_size": INT, "stage": STAGE, "pad_to": INT_OR_NONE,
         **RECIPE},
    ),
    "state_breakdown_by_stage": (
        {"n_params": 1e9, "world_size": 8},
        {"n_params": COUNT, "world_size": INT, "pad_to": INT_OR_NONE, **RECIPE},
    ),
    "activation_bytes_per_layer": (
        LAYER,
        {**SHAPE, "checkpointing": ["some", True, None], "tensor_parallel": INT,
         "sequence_parallel": FLAG, "attention": ATTENTION},
    ),
    "activation_breakdown_per_layer": (LAYER, SHAPE),
    "activation_bytes_saved_by_torch": (LAYER, {**SHAPE, "mask_bytes": COUNT}),
    "activation_bytes": (
        {"n_layers": 24, **LAYER},
        {"n_layers": COUNT, **SHAPE, "checkpointing": ["Full", 0, None],
         "tensor_parallel": INT, "sequence_parallel": FLAG, "attention": ATTENTION},
    ),
    "zero_paper_activation_bytes": (
        {"n_layers": 48, "seq_len": 1024, "batch": 32, "hidden": 1600},
        {"n_layers": COUNT, "seq_len": COUNT, "batch": COUNT, "hidden": COUNT},
    ),
    "gpt_shape": ({"n_params": 7e9}, {"n_params": COUNT, "hidden_per_layer": COUNT}),
    "fused_buffer_bytes": (
        {"n_params": 1.5e9},
        {"n_params": COUNT, "bytes_per_element": COUNT, "bucket_elements": COUNT_OR_NONE},
    ),
    "offload_state_bytes": (
        {"n_params": 7.5e9, "stage": 3, "world_size": 8},
        {"n_params": COUNT, "stage": STAGE, "world_size": INT, "offload_optimizer": FLAG,
         "offload_params": FLAG, **RECIPE},
    ),
    "deepspeed_zero2_estimate": (
        {"total_params": 2851 * 10**6, "num_gpus_per_node": 8},
        {"total_params": COUNT, "num_gpus_per_node": INT, "num_nodes": INT, "cpu_offload": FLAG,
         "additional_buffer_factor": POSITIVE, "legacy": FLAG},
    ),
    "deepspeed_zero3_estimate": (
        {"total_params": 2851 * 10**6, "largest_layer_params": 32 * 10**6},
        {"total_params": COUNT, "largest_layer_params": COUNT, "num_gpus_per_node": INT,
         "num_nodes": INT, "cpu_offload": FLAG, "cpu_offload_params": FLAG, "zero_init": FLAG,
         "additional_buffer_factor": POSITIVE},
    ),
    "deepspeed_gpu_gap": (
        {"n_params": 600_060_000, "stage": 3, "world_size": 2, "largest_layer_params": 10**8},
        {"n_params": COUNT, "stage": [0, 1, 4, 2.0, True, "3", None], "world_size": INT,
         "largest_layer_params": COUNT_OR_ZERO},
    ),
    "parse_count": (
        {"text": "7.6B"},
        {"text": [12, 7.6e9, None, "", "12", "xB", "-1B", "0B", "nanB", "infB", "7.6"]},
    ),
    "paper_figure1": ({}, {}),
    "paper_table1": ({}, {}),
    "paper_table2": ({}, {"gpu_bytes": POSITIVE, "world_size": INT}),
}
BAD_ARGUMENTS = [
    pytest.param(name, good, arg, bad, id=f"{name}-{arg}={bad!r}")
    for name, (good, refused) in PUBLIC_API.items()
    for arg, values in refused.items()
    for bad in values
]


def test_public_api_table_covers_every_argument_of_every_public_function():
    public = {
        name: fn for name, fn in vars(memory).items()
        if inspect.isfunction(fn) and fn.__module__ == memory.__name__ and name[0] != "_"
    }
    assert set(PUBLIC_API) == set(public)
    for name, fn in public.items():
        good, refused = PUBLIC_API[name]
        assert set(refused) == set(inspect.signature(fn).parameters), name
        fn(**good)  # the documented call still works


@pytest.mark.parametrize("name, good, arg, bad", BAD_ARGUMENTS)
def test_bad_argument_raises_value_error_naming_it_and_the_value(name, good, arg, bad):
    pattern = rf"^{re.escape(arg)} must .*; got {re.escape(repr(bad))}$"
    with pytest.raises(ValueError, match=pattern):
        getattr(memory, name)(**{**good, arg: bad})


def test_integral_floats_still_count_and_numpy_ints_are_ints():
    np = pytest.importorskip("numpy")
    assert memory.model_state_bytes(np.int64(10), np.int64(1), np.int64(4)) == (
        memory.model_state_bytes(10, 1, 4))
    assert memory.activation_bytes_per_layer(2048.0, 2.0, 4096.0, 32.0) == (
        memory.activation_bytes_per_layer(2048, 2, 4096, 32))
    assert memory.zero_paper_activation_bytes(48.0, 1024, 32, 1600.0) == (
        2 * 12 * 1600 * 32 * 1024 * 48)
    gap = memory.deepspeed_gpu_gap(7.5e9, 2, 8)
    assert gap == memory.deepspeed_gpu_gap(7_500_000_000, 2, 8)
    assert all(type(v) is int for v in gap.values())  # exact integer bytes, like the rest
    assert memory.fused_buffer_bytes(1.5e9, bytes_per_element=2.0) == 3 * GB


# -------------------------------------------------------------------- properties

n_params = st.integers(min_value=1, max_value=10**13)
world = st.integers(min_value=1, max_value=4096)
stage = st.sampled_from(memory.STAGES)
recipe = st.tuples(st.sampled_from(memory.PRECISIONS), st.sampled_from(memory.OPTIMIZERS))


@settings(max_examples=200, deadline=None)
@given(n=n_params, n_d=world, recipe=recipe)
def test_stage_ordering(n, n_d, recipe):
    totals = [memory.model_state_bytes(n, s, n_d, *recipe)["total"] for s in memory.STAGES]
    assert totals == sorted(totals, reverse=True)  # each stage holds no more than the last
    if n_d == 1:
        assert len(set(totals)) == 1  # one rank: nothing to shard


@settings(max_examples=200, deadline=None)
@given(n=n_params, n_d=world, s=stage, recipe=recipe)
def test_monotone_in_params_and_world_size(n, n_d, s, recipe):
    here = memory.model_state_bytes(n, s, n_d, *recipe)
    assert memory.model_state_bytes(n + 1, s, n_d, *recipe)["total"] >= here["total"]
    assert memory.model_state_bytes(n, s, n_d + 1, *recipe)["total"] <= here["total"]
    assert here["total"] == here["params"] + here["grads"] + here["optimizer"]


@settings(max_examples=200, deadline=None)
@given(n=n_params, n_d=world, recipe=recipe)
def test_stage3_is_one_nth_up_to_padding(n, n_d, recipe):
    full = memory.model_state_bytes(n, 0, n_d, *recipe)["total"]
    per_rank = memory.model_state_bytes(n, 3, n_d, *recipe)["total"]
    per_param = memory.bytes_per_param(*recipe)["total"]
    assert full <= n_d * per_rank < full + n_d * per_param


@settings(max_examples=100, deadline=None)
@given(gpu=st.integers(min_value=1, max_value=10**12), n_d=world, s=stage, recipe=recipe)
def test_largest_model_fits_and_next_does_not(gpu, n_d, s, recipe):
    best = memory.largest_model(gpu, n_d, s, *recipe)
    if best:
        assert memory.model_state_bytes(best, s, n_d, *recipe)["total"] <= gpu
    assert memory.model_state_bytes(best + 1, s, n_d, *recipe)["total"] > gpu


# -------------------------------------------------------------------- activations


def test_korthikanti_closed_form_equals_its_terms():
    for s, b, h, a in [(2048, 1, 12288, 96), (1024, 32, 1600, 25), (256, 2, 256, 4)]:
        terms = memory.activation_breakdown_per_layer(s, b, h, a)
        total = memory.activation_bytes_per_layer(s, b, h, a)
        assert sum(terms.values()) == total == s * b * h * 34 + 5 * a * s * s * b


def test_activation_variants():
    s, b, h, a, t = 2048, 4, 4096, 32, 8
    sbh = s * b * h
    assert memory.activation_bytes_per_layer(s, b, h, a, "selective") == 34 * sbh
    assert memory.activation_bytes_per_layer(s, b, h, a, "full") == 2 * sbh
    # Korthikanti eq. (2) and (4): tensor parallel, then with sequence parallelism
    tp = memory.activation_bytes_per_layer(s, b, h, a, tensor_parallel=t)
    assert tp == sbh * 10 + (24 * sbh + 5 * a * s * s * b) // t
    sp = memory.activation_bytes_per_layer(s, b, h, a, tensor_parallel=t, sequence_parallel=True)
    assert sp == (34 * sbh + 5 * a * s * s * b) // t
    # n layers with full checkpointing: n inputs plus one recomputed layer
    n = 24
    assert memory.activation_bytes(n, s, b, h, a, "full") == n * 2 * sbh + (
        34 * sbh + 5 * a * s * s * b
    )
    with pytest.raises(ValueError, match=r"checkpointing must be one of 'none', 'selective'"):
        memory.activation_bytes_per_layer(s, b, h, a, "some")


def test_fused_attention_keeps_no_s_squared_term():
    # FlashAttention / torch's SDPA keep Q, K, V, their output and one fp32 log-sum-exp per
    # head and token, and regenerate the softmax and its dropout mask in backward
    s, b, h, a, t = 4096, 4, 4096, 32, 8
    sbh = s * b * h
    fused = memory.activation_bytes_per_layer(s, b, h, a, attention="fused")
    assert fused == 34 * sbh + 4 * a * s * b
    unfused = memory.activation_bytes_per_layer(s, b, h, a)
    assert unfused - fused == 5 * a * s * s * b - 4 * a * s * b
    assert memory.activation_bytes_per_layer(s, b, h, a, "selective", attention="fused") == 34 * sbh
    assert memory.activation_bytes_per_layer(s, b, h, a, "full", attention="fused") == 2 * sbh
    tp = memory.activation_bytes_per_layer(s, b, h, a, tensor_parallel=t, attention="fused")
    assert tp == 10 * sbh + (24 * sbh + 4 * a * s * b) // t  # heads split: so does the lse
    # full checkpointing: the one layer recomputed in backward is fused too
    n = 32
    assert memory.activation_bytes(n, s, b, h, a, "full", attention="fused") == (
        n * 2 * sbh + 34 * sbh + 4 * a * s * b)
    # 7B-class at 4k tokens, micro-batch 4, fully checkpointed: the s^2 term of the one
    # recomputed layer is most of the unfused total
    unfused = memory.activation_bytes(n, s, b, h, a, "full")
    assert unfused / memory.activation_bytes(n, s, b, h, a, "full", attention="fused") > 2


@pytest.mark.parametrize("s, b, h, a", [(64, 2, 64, 4), (33, 3, 48, 3)])
def test_what_torchs_fused_attention_block_saves_is_the_fused_formula(s, b, h, a):
    torch = pytest.importorskip("torch")
    from zero_lab.course.workloads import Block
    from zero_lab.measure.memory import saved_activation_bytes

    block = Block(h, a).to(torch.bfloat16).train()  # F.scaled_dot_product_attention, no dropout
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    saved = saved_activation_bytes(lambda: block(x), exclude=block.parameters())
    no_dropout_masks = 2 * s * b * h  # Korthikanti's two sbh masks; Block has no dropout
    layernorm_stats = 2 * (2 * s * b * 2)  # a 16-bit mean and 1/std per token, two norms
    assert saved == (memory.activation_bytes_per_layer(s, b, h, a, attention="fused")
                     - no_dropout_masks + layernorm_stats)


@pytest.mark.parametrize("s, b, h, a", [(64, 2, 64, 4), (33, 3, 48, 3)])
def test_what_autograd_saves_for_a_gpt_layer_is_the_formula_to_the_byte(s, b, h, a):
    torch = pytest.importorskip("torch")
    from zero_lab.course.workloads import GPTLayer
    from zero_lab.measure.memory import saved_activation_bytes

    layer = GPTLayer(h, a).to(torch.bfloat16).train()
    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
    saved = saved_activation_bytes(lambda: layer(x), exclude=layer.parameters())
    assert saved == memory.activation_bytes_saved_by_torch(s, b, h, a)  # CPU: 2-byte masks
    assert saved > memory.activation_bytes_per_layer(s, b, h, a)
    with_params = saved_activation_bytes(lambda: layer(x))
    assert with_params > saved  # the weights are saved too, and `exclude` leaves them out
    checkpointed = saved_activation_bytes(
        lambda: torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False),
        exclude=layer.parameters())
    assert checkpointed == memory.activation_bytes_per_layer(s, b, h, a, "full") == 2 * s * b * h


def test_zero_paper_activation_and_buffer_examples():
    # ZeRO paper section 3.2: GPT-2 1.5B, s = 1K, b = 32 -> "about 60 GB"; a fused fp32
    # gradient buffer for 1.5B parameters -> 6 GB.
    assert round(memory.zero_paper_activation_bytes(48, 1024, 32, 1600) / GB) == 60
    assert memory.fused_buffer_bytes(1.5e9) == 6 * GB
    assert memory.fused_buffer_bytes(1.5e9, bucket_elements=25_000_000) == 100_000_000


def test_gpt_shape_recovers_gpt3():
    assert memory.gpt_shape(175e9) == {"n_layers": 96, "hidden": 12288, "heads": 96}
    shape = memory.gpt_shape(7e9)
    assert abs(12 * shape["n_layers"] * shape["hidden"] ** 2 - 7e9) / 7e9 < 0.1


# ----------------------------------------------------------------------- offload


def test_offload_stage2_keeps_only_params_on_gpu():
    psi, n = 8_000_000_000, 8
    r = memory.offload_state_bytes(psi, 2, n)
    assert r["gpu"] == {"params": 2 * psi, "grads": 0, "optimizer": 0, "total": 2 * psi}
    assert r["cpu"]["total"] == (2 + 12) * psi // n  # fp16 grad slice + fp32 master, m, v
    assert r["gpu"]["total"] + r["cpu"]["total"] == memory.model_state_bytes(psi, 2, n)["total"]


def test_offload_stage3_params_too():
    psi, n = 8_000_000_000, 8
    r = memory.offload_state_bytes(psi, 3, n, offload_optimizer=True, offload_params=True)
    assert r["gpu"]["total"] == 0
    assert r["cpu"]["total"] == 16 * psi // n
    only_opt = memory.offload_state_bytes(psi, 3, n)
    assert only_opt["gpu"]["total"] == 2 * psi // n


def test_offload_rejects_impossible_combinations():
    with pytest.raises(ValueError, match=r"offload_params needs stage 3"):
        memory.offload_state_bytes(100, 2, 2, offload_params=True)
    with pytest.raises(ValueError, match=r"offload_optimizer needs stage 1, 2 or 3"):
        memory.offload_state_bytes(100, 0, 2)


# --------------------------------------------------------------------- DeepSpeed

# DeepSpeed's memory docs (docs/code-docs/source/memory.rst), cold estimators for 2851M
# parameters, 32M in the largest layer, 1 node x 8 GPUs; printed as bytes / 2**30 "GB".
DS_DOCS_ZERO3 = [  # (cpu_offload, cpu_offload_params, zero_init), per CPU, per GPU
    ((True, True, True), 71.69, 0.12),
    ((True, True, False), 127.45, 0.12),
    ((True, False, True), 63.72, 0.78),
    ((True, False, False), 127.45, 0.78),
    ((False, False, True), 1.43, 6.09),
    ((False, False, False), 127.45, 6.09),
]


@pytest.mark.parametrize("options, cpu_gb, gpu_gb", DS_DOCS_ZERO3)
def test_deepspeed_zero3_estimator_matches_its_docs(options, cpu_gb, gpu_gb):
    cpu, gpu, largest = memory.deepspeed_zero3_estimate(2851 * 10**6, 32 * 10**6, 8, 1, *options)
    assert (round(cpu / GiB, 2), round(gpu / GiB, 2)) == (cpu_gb, gpu_gb)
    assert largest == 4 * 32 * 10**6


def test_deepspeed_zero2_estimator_matches_its_docs():
    cpu, gpu = memory.deepspeed_zero2_estimate(2851 * 10**6, 8, 1, cpu_offload=True)
    assert (round(cpu / GiB, 2), round(gpu / GiB, 2)) == (127.45, 5.31)
    _, legacy = memory.deepspeed_zero2_estimate(2851 * 10**6, 8, 1, False, legacy=True)
    assert round(legacy / GiB, 2) == 15.93  # the docs' example predates 2Ψ + 18Ψ/N
    _, current = memory.deepspeed_zero2_estimate(2851 * 10**6, 8, 1, False)
    assert current == 2 * 2851 * 10**6 + 18 * 2851 * 10**6 // 8


@pytest.mark.parametrize("psi, n, layer", [(600_060_000, 2, 100_010_000), (7 * 10**9, 8, 10**8),
                                           (2851 * 10**6, 64, 32 * 10**6)])
def test_course_plus_named_gap_equals_deepspeed(psi, n, layer):
    _, ds2 = memory.deepspeed_zero2_estimate(psi, n, 1, cpu_offload=False)
    _, ds3, _ = memory.deepspeed_zero3_estimate(psi, layer, n, 1, False, False)
    assert abs(memory.deepspeed_gpu_gap(psi, 2, n)["total"] - ds2) <= 2
    assert abs(memory.deepspeed_gpu_gap(psi, 3, n, layer)["total"] - ds3) <= 2
    # with the optimizer offloaded, both keep exactly the 2-byte parameters on the GPU
    _, ds2_off = memory.deepspeed_zero2_estimate(psi, n, 1, cpu_offload=True)
    assert ds2_off == memory.offload_state_bytes(psi, 2, n)["gpu"]["total"]
    with pytest.raises(ValueError, match="stage must be 2 or 3"):
        memory.deepspeed_gpu_gap(psi, 1, n)


def test_parse_count():
    assert memory.parse_count("7.6B") == 7.6e9
    assert memory.parse_count("0.5T") == 5e11
    with pytest.raises(ValueError, match="must end in one of M, B, T"):
        memory.parse_count("12")


# ------------------------------------------------- one vocabulary with shard() (issue 21, 14)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_the_calculator_speaks_shards_precision_names(name):
    """shard() accepts "bf16" and "fp16" (16-bit compute, fp32 masters): the calculator counts
    them as the mixed precision they are, and both modules name the same choices."""
    from zero_lab.stages import refusals  # what shard() checks its precision against

    assert memory.model_state_bytes(7.5e9, 3, 64, precision=name) == \
        memory.model_state_bytes(7.5e9, 3, 64, precision="mixed")
    assert memory.bytes_per_param(name)["total"] == 16
    assert refusals.PRECISIONS == memory.PRECISIONS


@pytest.mark.parametrize("text, count", [("7.6b", 7.6e9), ("340m", 3.4e8), (" 1.5T ", 1.5e12)])
def test_parse_count_takes_any_case_and_surrounding_spaces(text, count):
    assert memory.parse_count(text) == count
