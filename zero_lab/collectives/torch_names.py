"""torch's single-tensor all-gather and reduce-scatter under the names the course uses.

torch 2.13 (the course's pin) names them `dist.all_gather_single` and
`dist.reduce_scatter_single` and deprecates the older `all_gather_into_tensor` and
`reduce_scatter_tensor`; an older torch has only the older names (torch 2.11, as a CUDA image
ships it, did: the GPU check found every stage failing on the missing name). Same arguments,
same semantics, so on an older torch the new names are given the old functions, once per
process, before the rank script runs (rank_side._run_script calls `provide`). Nothing changes on
a torch that has them.
"""

from __future__ import annotations

NAMES = {"all_gather_single": "all_gather_into_tensor",
         "reduce_scatter_single": "reduce_scatter_tensor"}


def provide(dist) -> list[str]:
    """Give `dist` (torch.distributed) each new name it lacks; return the names given."""
    given = []
    for new, old in NAMES.items():
        if not hasattr(dist, new):
            setattr(dist, new, getattr(dist, old))
            given.append(new)
    return given
