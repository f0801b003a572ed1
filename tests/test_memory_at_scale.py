"""The fake process group's worker (notebook 07): rank 0 of N really holds what the formula
says, up to the padding of each flat group, for N up to 1024 and a model whose layers N
does not divide."""

from __future__ import annotations

from zero_lab import memory
from zero_lab.launch import torchrun
from zero_lab.launch.paths import WORKERS


def test_one_rank_of_n_holds_the_formula_plus_padding_up_to_n_1024():
    worlds = [1, 3, 64, 1024]
    result = torchrun(WORKERS / "memory_at_scale.py", nproc=1, stream=False, timeout=300,
                      args=["--width", "10", "--depth", "3", "--worlds", *worlds])
    rows = result.ranks[0]["rows"]
    assert {(r["world_size"], r["stage"]) for r in rows} == (
        {(n, s) for n in worlds for s in (1, 2, 3)} | {(1, 0), (1024, 0)})
    for r in rows:
        psi = r["psi"]
        assert psi == 3 * (10 * 10 + 10)
        assert r["predicted"] == memory.model_state_bytes(psi, r["stage"], r["world_size"],
                                                          "fp32", "adam")["total"]
        padding = r["held"]["total"] - r["predicted"]
        assert 0 <= padding <= 16 * r["world_size"] * r["groups"], r
        assert r["peak"] >= r["held"]["total"]
    third = {r["world_size"]: r["held"]["total"] for r in rows if r["stage"] == 3}
    assert third[3] < third[1] / 2 and third[1024] < third[64]


def test_the_gpt_keeps_its_tied_head_after_the_meta_device_build():
    # to_empty() gives every parameter its own storage, which unties the head from the token
    # embedding: the worker must re-tie it, or Ψ grows by vocab x width (75 -> 76 tensors)
    from zero_lab.course.workloads import TinyGPT, count_parameters

    shape = dict(vocab_size=96, seq_len=8, d_model=16, n_heads=2, n_layers=2, bias=False)
    tied = count_parameters(TinyGPT(**shape))
    result = torchrun(WORKERS / "memory_at_scale.py", nproc=1, stream=False, timeout=300,
                      args=["--model", "gpt", "--vocab", 96, "--seq", 8, "--width", 16,
                            "--heads", 2, "--depth", 2, "--worlds", 1, 4, "--stages", 3,
                            "--batch", 1])
    rows = result.ranks[0]["rows"]
    assert [r["psi"] for r in rows] == [tied, tied]
    for r in rows:
        assert r["predicted"] == memory.model_state_bytes(tied, 3, r["world_size"], "fp32",
                                                          "adam")["total"]
        assert 0 <= r["held"]["total"] - r["predicted"] <= 16 * r["world_size"] * r["groups"]
