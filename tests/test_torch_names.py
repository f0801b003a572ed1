"""zero_lab.collectives.torch_names: the course's collective names on a torch that lacks them."""

from types import SimpleNamespace

import torch.distributed as dist

from zero_lab.collectives import torch_names


def test_an_older_torch_gets_the_new_names_as_the_old_functions():
    def old_gather(*args, **kwargs):
        return ("gather", args, kwargs)

    def old_scatter(*args, **kwargs):
        return ("scatter", args, kwargs)

    older = SimpleNamespace(all_gather_into_tensor=old_gather, reduce_scatter_tensor=old_scatter)
    assert sorted(torch_names.provide(older)) == ["all_gather_single", "reduce_scatter_single"]
    assert older.all_gather_single is old_gather
    assert older.reduce_scatter_single is old_scatter


def test_a_torch_that_has_them_is_left_alone():
    before = (dist.all_gather_single, dist.reduce_scatter_single)
    assert torch_names.provide(dist) == []
    assert (dist.all_gather_single, dist.reduce_scatter_single) == before
