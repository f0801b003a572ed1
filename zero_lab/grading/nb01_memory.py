"""Notebook 01's checks: memory accounting, plain input -> output against `zero_lab.memory`.

The reference values come from the package's calculators; the wrong answers are the
mistakes learners make with the ZeRO paper's formulas (the fp32 master copy forgotten or
counted twice, one stage off, every stage treated alike).
"""

from __future__ import annotations

from collections.abc import Callable

from zero_lab import memory
from zero_lab.grading.framework import Case, run_cases, same


def check_bytes_per_param(fn: Callable) -> None:
    """Notebook 01: fn(precision, optimizer) -> {"params", "grads", "optimizer"} bytes/param.

    "optimizer" is the paper's K: everything the optimizer keeps, fp32 master copy included.
    """
    def reference(precision, optimizer):
        b = memory.bytes_per_param(precision, optimizer)
        return {key: b[key] for key in ("params", "grads", "optimizer")}

    def forgot_master(precision, optimizer):
        b = reference(precision, optimizer)
        return {**b, "optimizer": memory.bytes_per_param(precision, optimizer)["optimizer_states"]}

    def half_precision_states(precision, optimizer):
        b = reference(precision, optimizer)
        if precision == "mixed":
            states = memory.bytes_per_param(precision, optimizer)["optimizer_states"]
            b["optimizer"] = 4 + states // 2
        return b

    cases = [
        Case(
            args=(precision, optimizer),
            expected=reference(precision, optimizer),
            hint=f"{precision}: params and grads are "
            f"{'fp32 (4 bytes)' if precision == 'fp32' else '16-bit (2 bytes)'}; "
            f"{optimizer} keeps {memory.OPTIMIZER_STATES[optimizer]} fp32 state tensor(s)",
        )
        for precision in ("fp32", "mixed")  # the exercise's two names (bf16, fp16 = mixed)
        for optimizer in memory.OPTIMIZERS
    ]
    run_cases(
        "check_bytes_per_param",
        fn,
        cases,
        wrong_answers=[
            (
                forgot_master,
                "mixed precision also keeps an fp32 master copy of the weights (4 bytes); "
                "the update is applied to it, and the paper counts it in K",
            ),
            (
                half_precision_states,
                "optimizer states stay fp32 (4 bytes each) in mixed precision; only the "
                "working params and grads are 16-bit",
            ),
        ],
        shows="you can turn a precision recipe into the bytes each parameter costs",
    )


_K_TO_OPTIMIZER = {12: "adam", 8: "sgd_momentum", 4: "sgd"}  # mixed precision: K = 4 + 4·states


def _paper_bytes(psi, stage, n_d, k=12):
    return memory.model_state_bytes(psi, stage, n_d, "mixed", _K_TO_OPTIMIZER[k])["total"]


def check_per_rank_bytes(fn: Callable) -> None:
    """Notebook 01: fn(psi, stage, n_d, k=12) -> per-rank model-state bytes (paper's formula)."""
    stage_hints = {
        0: "plain data parallelism: every rank holds everything, (2 + 2 + K)·Ψ",
        1: "stage 1 shards only the optimizer: 2Ψ + 2Ψ + K·Ψ/N_d",
        2: "stage 2 shards gradients and optimizer: 2Ψ + (2 + K)·Ψ/N_d",
        3: "stage 3 shards all three: (2 + 2 + K)·Ψ/N_d",
    }
    configs = [
        (7.5e9, 0, 64, 12),
        (7.5e9, 1, 64, 12),
        (7.5e9, 2, 64, 12),
        (7.5e9, 3, 64, 12),
        (128e9, 1, 1024, 12),
        (128e9, 2, 16, 12),
        (1e12, 3, 1024, 12),
        (6.4e9, 2, 8, 8),
        (6.4e9, 1, 4, 4),
        (1e9, 3, 1, 12),
    ]
    cases = [
        Case(args=(psi, stage, n_d), kwargs={"k": k}, expected=_paper_bytes(psi, stage, n_d, k),
             hint=stage_hints[stage])
        for psi, stage, n_d, k in configs
    ]

    def one_stage_off(delta):
        return lambda psi, stage, n_d, k=12: _paper_bytes(psi, min(max(stage + delta, 0), 3),
                                                          n_d, k)

    def master_counted_twice(psi, stage, n_d, k=12):  # K already holds the master copy
        k = k + 4
        return {0: (4 + k) * psi, 1: 4 * psi + k * psi / n_d,
                2: 2 * psi + (2 + k) * psi / n_d, 3: (4 + k) * psi / n_d}[stage]

    run_cases(
        "check_per_rank_bytes",
        fn,
        cases,
        wrong_answers=[
            (one_stage_off(+1), "you sharded one state too many: this is the next stage's "
                                "formula. Stage 1 shards the optimizer only; stage 2 adds the "
                                "gradients; stage 3 adds the parameters"),
            (one_stage_off(-1), "you sharded one state too few: this is the previous stage's "
                                "formula"),
            (master_counted_twice, "K already includes the fp32 master copy (12 = 4 master "
                                   "+ 4 m + 4 v for Adam); do not add it again"),
        ],
        shows="you can say what each stage divides by N and what it leaves whole on every rank",
    )


def check_largest_model(fn: Callable) -> None:
    """Notebook 01: fn(gpu_bytes, n_d, stage, k=12) -> the largest Ψ whose states fit."""
    configs = [
        (32e9, 64, 0, 12),
        (32e9, 64, 1, 12),
        (32e9, 64, 2, 12),
        (32e9, 64, 3, 12),
        (80 * 2**30, 8, 2, 12),
        (80 * 2**30, 8, 3, 12),
        (24 * 2**30, 1, 0, 8),
        (40e9, 1024, 1, 4),
    ]
    cases = [
        Case(
            args=(gpu, n_d, stage),
            kwargs={"k": k},
            expected=float(memory.largest_model(gpu, n_d, stage, "mixed", _K_TO_OPTIMIZER[k])),
            hint="solve per_rank_bytes(Ψ) = gpu_bytes for Ψ; only the sharded part is "
            "divided by N_d",
        )
        for gpu, n_d, stage, k in configs
    ]

    def same_for_all_stages(gpu, n_d, stage, k=12):
        return gpu / (4 + k)

    def everything_sharded(gpu, n_d, stage, k=12):
        return gpu * n_d / (4 + k)

    def close(expected, got):  # a float answer may differ from the integer one by < N_d
        return same(expected, got, rel=1e-6)

    run_cases(
        "check_largest_model",
        fn,
        cases,
        compare=close,
        wrong_answers=[
            (same_for_all_stages, "this is plain data parallelism's limit for every stage; "
                                  "ZeRO shards part of the 16 bytes over N_d ranks"),
            (everything_sharded, "only stage 3 divides all of (2 + 2 + K)·Ψ by N_d; stages "
                                 "1 and 2 keep a full copy of the params (and grads)"),
        ],
        shows="you can turn the formula around: the largest model a GPU holds at each stage",
    )
