"""Optimizer parameter groups at load: matched by the parameters they hold, never by position.

The manifest records, for every parameter, the index of the group it was in when saved, and
each group's settings (lr, weight decay, betas, ...). An optimizer function that lists the
same groups in another order (a refactor, another filter) gives group 0 to the biases where it
was the weights': by position, the biases would get the weights' learning rate and weight
decay. So each group of the optimizer takes the settings of the saved group its parameters
were in; a group whose parameters were in two saved groups has no single answer and is
refused, with both layouts named.
"""

from __future__ import annotations

from zero_lab.checkpoint.manifest import CheckpointError


def local_names(opt) -> list[list[str]]:
    """Per optimizer group, the parameters this rank holds pieces of in it (another rank may
    hold the rest: gather them)."""
    group_of = {id(t): k for k, pg in enumerate(opt.optim.param_groups) for t in pg["params"]}
    names: list[list[str]] = [[] for _ in opt.optim.param_groups]
    for pc, view in zip(opt.pieces, opt.views, strict=True):
        k = group_of.get(id(view))
        name = opt.sync.groups[pc.group].names[pc.param]
        if k is not None and name not in names[k]:
            names[k].append(name)
    return names


def merged(per_rank: list[list[list[str]]]) -> list[list[str]]:
    """Per group, the names any rank holds (each once, in first-seen order)."""
    out: list[list[str]] = [[] for _ in per_rank[0]]
    for names in per_rank:
        for k, group in enumerate(names):
            out[k] += [n for n in group if n not in out[k]]
    return out


def saved_layout(manifest: dict) -> dict[int, list[str]]:
    layout: dict[int, list[str]] = {}
    for name, meta in manifest["parameters"].items():
        if meta.get("param_group") is not None:
            layout.setdefault(meta["param_group"], []).append(name)
    return dict(sorted(layout.items()))


def match_groups(where: str, manifest: dict, groups: list[list[str]]) -> list[int | None]:
    """For each of the optimizer's groups (its parameters' names), the saved group whose
    settings it takes (None: none of its parameters was in a saved group)."""
    saved_of = {name: meta.get("param_group") for name, meta in manifest["parameters"].items()}
    n_saved = len(manifest["optimizer"]["param_groups"])
    matches: list[int | None] = []
    for k, names in enumerate(groups):
        found = sorted({saved_of[n] for n in names if saved_of.get(n) is not None})
        if len(found) > 1 or any(j >= n_saved for j in found):
            raise CheckpointError(
                f"{where}: the optimizer's group {k} holds parameters of saved groups {found}; "
                "groups are matched by the parameters they hold, and this one has no single "
                f"saved setting. Saved: {_describe(saved_layout(manifest))}; now: "
                f"{_describe(dict(enumerate(groups)))}")
        matches.append(found[0] if found else None)
    return matches


def _describe(layout: dict[int, list[str]]) -> str:
    return "; ".join(f"group {k}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                     for k, names in layout.items())
