"""zero_lab.stages.partition: the padded flat buffer every stage shares.

Layout properties are checked in-process for many shapes and world sizes (hypothesis); the
collectives (reduce-scatter into the owned slice, all-gather of the full buffer after its
storage was freed) on real gloo ranks, from the same launches as tests/test_stages.py.
"""

from __future__ import annotations

import pytest
import torch
from common import WORLD_SIZES, stage_case_reports
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from zero_lab.stages.partition import (
    FlatParamGroup,
    allocate_storage,
    bucket_parameters,
    free_storage,
    storage_is_allocated,
)

shapes = st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple),
                  min_size=1, max_size=6)


def _params(shape_list) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in shape_list]


@settings(max_examples=60, deadline=None)
@given(shape_list=shapes, world_size=st.integers(1, 8))
def test_layout_pads_to_equal_slices(shape_list, world_size):
    params = _params(shape_list)
    group = FlatParamGroup(params, world_size, rank=0)
    numel = sum(p.numel() for p in params)
    assert group.numel == numel
    assert group.padded_numel % world_size == 0
    assert 0 <= group.padding < world_size  # the least padding that gives equal slices
    assert group.shard_numel * world_size == group.padded_numel
    ranges = [group.shard_range(r) for r in range(world_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == group.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # contiguous


@settings(max_examples=60, deadline=None)
@given(shape_list=shapes, world_size=st.integers(1, 8))
def test_shard_pieces_cover_every_element_once(shape_list, world_size):
    """Each parameter element is owned by exactly one rank, wherever the slices cut."""
    params = _params(shape_list)
    owned = [torch.zeros(p.numel(), dtype=torch.int64) for p in params]
    for rank in range(world_size):
        group = FlatParamGroup(params, world_size, rank)
        flat = group.flatten()
        mine = group.shard(flat)
        for piece in group.shard_pieces():
            owned[piece.index][piece.param_start:piece.param_end] += 1
            # the piece's elements sit where it says in this rank's slice
            expected = params[piece.index].detach().reshape(-1)[piece.param_start:piece.param_end]
            assert torch.equal(mine[piece.shard_start:piece.shard_start + piece.numel], expected)
    assert all((o == 1).all() for o in owned)


@settings(max_examples=40, deadline=None)
@given(shape_list=shapes, world_size=st.integers(1, 5))
def test_bind_makes_parameters_views_of_the_buffer(shape_list, world_size):
    params = _params(shape_list)
    ids = [id(p) for p in params]
    values = [p.detach().clone() for p in params]
    group = FlatParamGroup(params, world_size, rank=world_size - 1)
    group.bind(group.flatten())
    assert [id(p) for p in params] == ids  # same Parameter objects (modules keep them)
    for p, v in zip(params, values, strict=True):
        assert torch.equal(p, v)
        assert p.untyped_storage().data_ptr() == group.flat.untyped_storage().data_ptr()
    assert (group.flat[group.numel:] == 0).all()  # padding is zero
    with torch.no_grad():
        group.flat.add_(1.0)
    assert all(torch.equal(p, v + 1) for p, v in zip(params, values, strict=True))


def test_views_into_other_buffers_and_dtypes():
    params = _params([(2, 3), (4,)])
    group = FlatParamGroup(params, world_size=4, rank=1)
    grad = group.new_full(torch.bfloat16)
    assert grad.dtype == torch.bfloat16 and grad.numel() == 12
    views = group.views(grad)
    assert [v.shape for v in views] == [torch.Size([2, 3]), torch.Size([4])]
    views[1].fill_(2.0)
    assert grad[6:10].eq(2).all() and grad[:6].eq(0).all()
    assert group.new_shard().numel() == 3
    with pytest.raises(ValueError, match="expected a 1-D buffer of 12 elements"):
        group.views(torch.zeros(10))


def test_free_and_allocate_storage_keep_the_views():
    params = _params([(3, 3), (5,)])
    group = FlatParamGroup(params, world_size=2, rank=0)
    group.bind(group.flatten())
    free_storage(group.flat)
    assert not storage_is_allocated(group.flat)
    assert all(p.untyped_storage().nbytes() == 0 for p in params)  # the memory is gone
    assert params[0].shape == (3, 3)  # ... but the tensors keep their shapes
    allocate_storage(group.flat)
    assert group.flat.untyped_storage().nbytes() == group.padded_numel * 4
    with torch.no_grad():
        group.flat.copy_(torch.arange(group.padded_numel, dtype=torch.float32))
    assert torch.equal(params[1], torch.arange(9, 14, dtype=torch.float32))  # views see it
    with pytest.raises(ValueError, match="expects the whole buffer"):
        allocate_storage(group.flat[1:])


def test_group_rejects_bad_input():
    p = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="at least one parameter"):
        FlatParamGroup([], 2, 0)
    with pytest.raises(ValueError, match="same parameter twice"):
        FlatParamGroup([p, p], 2, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        FlatParamGroup([p], 2, 2)
    with pytest.raises(ValueError, match="one device and one dtype"):
        FlatParamGroup([p, nn.Parameter(torch.zeros(2, dtype=torch.float64))], 2, 0)


def test_buckets_respect_the_size_and_keep_order():
    params = [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate([3, 4, 10, 2, 2, 1])]
    buckets = bucket_parameters(params, bucket_bytes=6 * 4, element_size=4)
    assert [[n for n, _ in b] for b in buckets] == [["p0"], ["p1"], ["p2"], ["p3", "p4", "p5"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in params]
    # a parameter larger than a bucket gets one of its own; no other bucket exceeds the size
    assert all(sum(p.numel() for _, p in b) <= 6 or len(b) == 1 for b in buckets)
    assert len(bucket_parameters(params, 1e9, 4)) == 1
    with pytest.raises(ValueError, match="bucket size must be positive"):
        bucket_parameters(params, 0, 4)


def test_first_bucket_fills_until_it_holds_first_bucket_bytes():
    """DDP's rule: the first bucket (the last layer, in backward order) takes parameters until
    it holds at least `first_bucket_bytes`, so a bias does not go out alone."""
    params = [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate([1, 4, 4, 4, 9])]
    buckets = bucket_parameters(params, bucket_bytes=40, element_size=4, first_bucket_bytes=8)
    assert [[n for n, _ in b] for b in buckets] == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    # never more than bucket_bytes for the first bucket either
    buckets = bucket_parameters(params, bucket_bytes=16, element_size=4, first_bucket_bytes=8)
    assert [[n for n, _ in b] for b in buckets] == [["p0"], ["p1"], ["p2"], ["p3"], ["p4"]]


# ------------------------------------------------------------------ on real ranks


@pytest.mark.parametrize("n", WORLD_SIZES, ids=lambda n: f"N={n}")
def test_collectives_on_the_flat_buffer(n):
    """reduce_scatter gives each rank the average of its slice; all_gather rebuilds the full
    buffer, even after its storage was freed and re-allocated (what stage 3 does)."""
    reports = stage_case_reports(n)
    expected_pieces = {}
    params = _params([(3, 5), (7,), (), (2, 2, 3)])
    for rank, rep in enumerate(reports):
        part = rep["partition"]
        assert (part["numel"], part["padded"]) == (35, -(-35 // n) * n)
        assert part["rs_error"] == 0.0 and part["ag_error"] == 0.0
        assert part["freed_bytes"] == [0, 0, 0, 0]
        assert part["restored_bytes"] == part["padded"] * 4
        group = FlatParamGroup(params, n, rank)
        expected_pieces[rank] = [[p.index, p.param_start, p.param_end, p.shard_start]
                                 for p in group.shard_pieces()]
        assert part["pieces"] == expected_pieces[rank]
