"""The seed blog's ZeRO (zero_lab/course/seed_blog.py) and the deep-MLP worker of notebooks 03-04
(zero_lab/workers/deep_mlp_runs.py): the blog's ownership rule, and one small launch that
trains a zero_lab stage and the blog's ZeRO-1/2 on 2 gloo ranks."""

from __future__ import annotations

import json
from functools import cache

import pytest

from zero_lab.course.seed_blog import owned_indices, owner_ranks
from zero_lab.launch import torchrun
from zero_lab.launch.paths import WORKERS

# ------------------------------------------------------------------ ownership rule


def test_the_blogs_own_example_100_tensors_on_3_ranks():
    # The blog's section 6.2.2 code gives 34 / 33 / 33 (indices 0-33, 34-66, 67-99). Its
    # example text beside that code says 34 / 34 / 32 (0-33, 34-67, 68-99), which its own
    # rule cannot produce: the text contradicts the code, and the code is what ran.
    ranges = [owned_indices(100, 3, r) for r in range(3)]
    assert [len(r) for r in ranges] == [34, 33, 33]
    assert ranges == [range(0, 34), range(34, 67), range(67, 100)]


@pytest.mark.parametrize("n_tensors", [0, 1, 2, 5, 12, 100, 101])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_ranges_tile_the_tensors_and_agree_with_the_owner_rule(n_tensors, world_size):
    """Section 6.2.2's ranges and section 6.2.4's recomputed owners are one rule: consecutive
    whole tensors, n // N each, the first n % N ranks one more."""
    ranges = [owned_indices(n_tensors, world_size, r) for r in range(world_size)]
    assert [i for r in ranges for i in r] == list(range(n_tensors))
    sizes = [len(r) for r in ranges]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    owners = owner_ranks(n_tensors, world_size)
    assert owners == [r for r, rng in enumerate(ranges) for _ in rng]


# ------------------------------------------------------------------ the worker

WIDTH, DEPTH, BATCH, STEPS = 32, 3, 8, 3
RUNS = {"stage 2, 1 MB buckets": {"stage": 2, "bucket_mb": 1},
        "blog ZeRO-1": {"blog": 1}, "blog ZeRO-2": {"blog": 2}}
FIELDS = {"held_after_backward", "peak_bytes", "comm", "volume", "sent_bytes", "step_ms",
          "max_abs_diff"}


@cache
def deep_mlp_reports() -> tuple[dict, ...]:
    result = torchrun(WORKERS / "deep_mlp_runs.py", nproc=2, backend="gloo", stream=False,
                      timeout=300, args=["--width", WIDTH, "--depth", DEPTH, "--batch", BATCH,
                                         "--steps", STEPS, "--runs", json.dumps(RUNS)])
    return tuple(result.ranks)


def test_the_worker_reports_every_requested_run():
    psi = DEPTH * (WIDTH * WIDTH + WIDTH)
    for rep in deep_mlp_reports():
        assert rep["n_params"] == psi and rep["largest_param"] == WIDTH * WIDTH
        assert list(rep["runs"]) == list(RUNS)
        for run in rep["runs"].values():
            assert set(run) == FIELDS
            assert run["peak_bytes"] >= run["held_after_backward"]["total"] > 0
            assert run["step_ms"] > 0
        assert "collective_ms" not in rep  # only with --time-collectives


def test_stage_runs_and_the_blogs_zero_train_like_one_process():
    # the blog's mistakes cost memory and bytes, not correctness
    for rep in deep_mlp_reports():
        for label, run in rep["runs"].items():
            assert run["max_abs_diff"] < 1e-5, label


def test_the_blogs_zero2_keeps_every_gradient_and_sends_n_copies():
    reports = deep_mlp_reports()
    psi, n = reports[0]["n_params"], len(reports)
    for rep in reports:
        runs = rep["runs"]
        assert runs["blog ZeRO-2"]["held_after_backward"]["grads"] == 4 * psi  # not 4Ψ/N
        assert runs["stage 2, 1 MB buckets"]["held_after_backward"]["grads"] < 4 * psi
        assert set(runs["blog ZeRO-1"]["comm"]) == {"all_reduce", "broadcast"}
        # one "reduce-scatter" per tensor, each with N copies of the gradient as input
        blog_rs = runs["blog ZeRO-2"]["comm"]["reduce_scatter"]
        assert blog_rs["count"] == 2 * DEPTH and blog_rs["nbytes"] == n * 4 * psi
