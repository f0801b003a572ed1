"""The names outside checks call (the course's public API) stay where they are, whatever the
package's layout: a module move that breaks one of these breaks every check that imports it."""

from __future__ import annotations

import inspect


def test_the_public_names_import():
    from zero_lab import checkpoint, memory
    from zero_lab.launch import LaunchError, report, torchrun
    from zero_lab.stages import full_state_dict, shard

    assert callable(memory.model_state_bytes) and callable(memory.largest_model)
    assert all(callable(f) for f in (checkpoint.save, checkpoint.load, checkpoint.consolidate,
                                     torchrun, report, full_state_dict, shard))
    assert issubclass(LaunchError, Exception)
    import zero_lab.memory  # noqa: F401 - the dotted form works too


def test_shard_takes_the_public_arguments_in_their_order():
    from zero_lab.stages import shard

    params = list(inspect.signature(shard).parameters.values())
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ["model", "stage", "optimizer", "bucket_mb", "prefetch", "precision"]
    assert all(p.kind is p.KEYWORD_ONLY for p in params[len(positional):])


def test_the_calculators_answer_as_the_api_says():
    from zero_lab import memory

    states = memory.model_state_bytes(1_000_000, 3, 4, precision="mixed", optimizer="adam")
    assert set(states) >= {"params", "grads", "optimizer", "total"}
    assert states["total"] == 16 * 1_000_000 // 4
    assert memory.largest_model(80e9, 8, 3) > memory.largest_model(80e9, 8, 0)
