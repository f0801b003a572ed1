"""Notebook 07's check: choose a stage and a world size for a model and a cluster.

Any choice is accepted that `zero_lab.projection.candidates` says fits in the GPU's memory
(model states + activations) and meets the step-time bound; the reference is the cheapest
such choice (fewest ranks, then the lowest stage). The wrong answers are the shortcuts:
forgetting the activations, ignoring the time bound, and the stage-0 reflex.
"""

from __future__ import annotations

from collections.abc import Callable

from zero_lab.grading.framework import Case, run_cases
from zero_lab.projection import candidates

GiB = 2**30


class AnyValidChoice:
    """The expected value of a case: any (stage, world_size) meeting its constraints."""

    def __init__(self, kwargs: dict) -> None:
        self.kwargs = kwargs

    def accepts(self, got) -> bool:
        try:
            stage, world = got
        except (TypeError, ValueError):
            return False
        if world not in self.kwargs["world_sizes"] or stage not in (0, 1, 2, 3):
            return False
        row = _rows(self.kwargs, world)[stage]
        return row["fits_memory"] and row["meets_time"]

    def __repr__(self) -> str:
        return (f"any (stage, world_size) that fits and meets the time bound, e.g. "
                f"{reference_choice(**self.kwargs)}")


def _rows(kw: dict, world: int) -> list[dict]:
    return candidates(kw["n_params"], kw["gpu_bytes"], world, kw["link"], kw["compute_s"],
                      activation_bytes=kw["activation_bytes"], max_step_s=kw["max_step_s"])


def reference_choice(n_params, gpu_bytes, world_sizes, link, compute_s, activation_bytes,
                     max_step_s) -> tuple[int, int] | None:
    kw = dict(n_params=n_params, gpu_bytes=gpu_bytes, link=link, compute_s=compute_s,
              activation_bytes=activation_bytes, max_step_s=max_step_s)
    for world in sorted(world_sizes):
        for row in _rows(kw, world):
            if row["fits_memory"] and row["meets_time"]:
                return row["stage"], world
    return None


def _forgets_activations(n_params, gpu_bytes, world_sizes, link, compute_s, activation_bytes,
                         max_step_s):
    return reference_choice(n_params, gpu_bytes, world_sizes, link, compute_s, 0, max_step_s)


def _ignores_time(n_params, gpu_bytes, world_sizes, link, compute_s, activation_bytes,
                  max_step_s):
    return reference_choice(n_params, gpu_bytes, world_sizes, link, compute_s,
                            activation_bytes, None)


def _stage0_reflex(n_params, gpu_bytes, world_sizes, link, compute_s, activation_bytes,
                   max_step_s):
    return 0, max(world_sizes)


CASES = [  # (model, GPU, world sizes on offer, link, compute per step, activations, bound)
    dict(n_params=1.3e9, gpu_bytes=24 * GiB, world_sizes=[1, 2, 4, 8], link="pcie4",
         compute_s=0.9, activation_bytes=12 * GiB, max_step_s=1.2),
    dict(n_params=7e9, gpu_bytes=80 * GiB, world_sizes=[8, 16, 64], link="nvlink4",
         compute_s=1.7, activation_bytes=30 * GiB, max_step_s=2.0),
    dict(n_params=13e9, gpu_bytes=80 * GiB, world_sizes=[8, 16, 32, 64], link="infiniband_ndr",
         compute_s=3.0, activation_bytes=20 * GiB, max_step_s=3.3),
    dict(n_params=70e9, gpu_bytes=80 * GiB, world_sizes=[16, 32, 64, 128],
         link="infiniband_ndr", compute_s=8.0, activation_bytes=24 * GiB, max_step_s=9.0),
]


def _compare(expected, got) -> bool:
    """A case's expected value accepts any valid choice; a known mistake's value (a plain
    tuple, when run_cases looks for the mistake a learner made) must be equal."""
    if isinstance(expected, AnyValidChoice):
        return expected.accepts(got)
    return tuple(expected) == tuple(got) if expected is not None and got is not None else False


def check_stage_choice(fn: Callable) -> None:
    """Notebook 07: fn(n_params, gpu_bytes, world_sizes, link, compute_s, activation_bytes,
    max_step_s) -> (stage, world_size) that fits and meets the bound."""
    cases = [Case(kwargs=kw, expected=AnyValidChoice(kw),
                  label=f"({kw['n_params'] / 1e9:g}B params, {kw['gpu_bytes'] / GiB:g} GiB "
                        f"GPUs, N in {kw['world_sizes']}, {kw['link']}, step <= "
                        f"{kw['max_step_s']} s)",
                  hint="per rank, model states (memory.model_state_bytes) + activations must "
                       "fit, and the projected step (projection.project_step) must meet the "
                       "bound; projection.candidates evaluates both for every stage")
             for kw in CASES]
    run_cases("check_stage_choice", fn, cases, compare=_compare,
              wrong_answers=[
                  (_forgets_activations, "the activations need memory too: states + "
                                         "activations must fit"),
                  (_ignores_time, "that choice fits but its projected step is over the bound"),
                  (_stage0_reflex, "stage 0 replicates everything: at these sizes the "
                                   "model states alone do not fit"),
              ])
