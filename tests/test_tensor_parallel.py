"""`predict/tensor_parallel.py`: FSDP2 on tensor parallelism, by its construction (notebook 10).
Pure Python; notebook 10's launch holds the same formulas to what 4 gloo ranks measure
(tests/test_nb10_at_work.py)."""

from __future__ import annotations

import pytest

from zero_lab import memory
from zero_lab.predict import tensor_parallel as tp


def test_a_rank_holds_psi_over_t_times_d():
    assert tp.held_elements(65_536, 2, 2) == 16_384
    assert tp.held_elements(65_536, 4, 1) == tp.held_elements(65_536, 1, 4)


def test_model_states_do_not_depend_on_how_n_is_split():
    """16Ψ/N fully sharded, whatever t: 70B with Adam on 8 GPUs fits with TP no better."""
    psi = 70e9
    states = {tp.model_state_bytes(psi, t, 8 // t) for t in (1, 2, 4, 8)}
    assert states == {memory.model_state_bytes(psi, 3, 8)["total"]}
    assert states.pop() > 80 * memory.GiB


def test_tp_divides_the_gathered_unit():
    assert tp.gathered_unit_bytes(1000, 1) == 2000
    assert tp.gathered_unit_bytes(1000, 4) == 500


def test_the_step_messages_of_two_blocks_on_a_2x2_mesh():
    """Hand-counted: two blocks of 32,768 parameters, fp32, b·s·h = 2,048 elements."""
    got = tp.step_messages(32_768, 2, t=2, d=2, activation_elems=2_048)
    shard = 32_768 // 2 * 4
    assert got == {
        "dp all_gather forward": {"count": 2, "nbytes": shard, "sent_bytes": 2 * shard / 2},
        "dp all_gather backward": {"count": 2, "nbytes": shard, "sent_bytes": 2 * shard / 2},
        "dp reduce_scatter backward": {"count": 2, "nbytes": shard, "sent_bytes": 2 * shard / 2},
        "tp all_reduce forward": {"count": 2, "nbytes": 8_192, "sent_bytes": 2 * 8_192},
        "tp all_reduce backward": {"count": 1, "nbytes": 8_192, "sent_bytes": 8_192},
    }


def test_the_options_change_what_they_should():
    base = tp.step_messages(1024, 3, 2, 4, 64)
    kept = tp.step_messages(1024, 3, 2, 4, 64, reshard_after_forward=False)
    assert "dp all_gather backward" not in kept
    grad_in = tp.step_messages(1024, 3, 2, 4, 64, input_requires_grad=True)
    assert grad_in["tp all_reduce backward"]["count"] == 3
    assert base["tp all_reduce backward"]["count"] == 2
    assert base["dp all_gather forward"]["sent_bytes"] == 3 * 3 / 4 * 512 * 4


def test_one_dim_of_size_one_sends_nothing_on_it():
    only_fsdp = tp.step_messages(1024, 2, t=1, d=4, activation_elems=64)
    assert {k.split()[0] for k in only_fsdp} == {"dp"}
    only_tp = tp.step_messages(1024, 2, t=4, d=1, activation_elems=64)
    assert {k.split()[0] for k in only_tp} == {"tp"}


def test_a_mesh_of_no_ranks_is_refused():
    with pytest.raises(ValueError, match="mesh sizes"):
        tp.held_elements(10, 0, 2)
