"""A notebook's parameters, checked before any work: the cell after the `parameters` cell.

papermill (`make run`, `papermill -p/-r`) replaces a notebook's parameters without knowing
what they mean: `-r nproc 2` passes the string "2", `-p nproc 3` a rank count that does not
split a batch of 16. Without a check the first launch fails half a minute in, inside torch.
Every notebook's validation cell makes one call:

    backend = check_parameters(nproc, backend, device, width=width, depth=depth, batch=batch,
                               divides={"batch": batch},
                               rank_bytes=lambda: mlp_rank_bytes(width, depth, batch))

which refuses, naming the parameter, its value and the rule (TypeError for a wrong type,
ValueError for a wrong value), and returns the backend the notebook's launches run on:
`device` decides it ("cpu": gloo, "cuda": NCCL on one GPU a rank, refused without them).
It imports zero_lab.launch, which imports torch only where it needs to.

That cell is the one place a notebook's rules are written: `make run` runs it too, without a
kernel, for every notebook before the first one starts (course/preflight.py), so that
NPROC=1 is refused at once rather than when notebook 02 is reached. So the cell reads only the
parameters cell's names, and does nothing but check.
"""

from __future__ import annotations

from zero_lab.launch import BACKENDS, DEVICES, capacity, resolve_backend
from zero_lab.launch.capacity import RANK_BASE_BYTES

STRING_HINT = " (papermill's -r passes strings; -p reads numbers and lists)"


class TooFewRanks(ValueError):
    """nproc below what a notebook needs: what it measures happens between ranks (its bytes,
    its exposed communication, its fit of latency and bandwidth), and one rank sends nothing.
    `make gpu-check` on a machine with fewer GPUs reports such a notebook as skipped."""


def _refuse(name: str, value, rule: str, error=ValueError):
    items = value.values() if isinstance(value, dict) else value
    strings = isinstance(value, str) or (isinstance(value, (list, tuple, dict))
                                         and any(isinstance(x, str) for x in items))
    hint = STRING_HINT if strings else ""
    raise error(f"parameter {name}={value!r}: must be {rule}{hint}")


def _is_positive(x, numbers: bool) -> bool:
    kinds = (int, float) if numbers else int
    return isinstance(x, kinds) and not isinstance(x, bool) and x > 0


def _check_size(name: str, value, numbers: bool = False) -> None:
    """A positive int (positive number where `numbers`), or a non-empty list or dict of them."""
    what = "positive number" if numbers else "positive int"
    if isinstance(value, (list, tuple)):
        items, rule = list(value), f"a non-empty list of {what}s"
    elif isinstance(value, dict):
        items, rule = list(value.values()), f"a non-empty dict of {what}s"
    else:
        items, rule = [value], f"a {what}"
    kinds = (int, float) if numbers else int
    if any(isinstance(x, bool) or not isinstance(x, kinds) for x in items):
        _refuse(name, value, rule, TypeError)
    if not items or not all(_is_positive(x, numbers) for x in items):
        _refuse(name, value, rule)


def _check_divides(name: str, spec, nproc: int) -> None:
    """`spec`: rows nproc must divide, or (rows, parts, what the parts are)."""
    rows, parts, what = (spec, nproc, None) if not isinstance(spec, tuple) else spec
    _check_size(name, rows)
    if rows % parts == 0:
        return
    if what is None:
        fits = ", ".join(str(d) for d in range(1, rows + 1) if rows % d == 0)
        _refuse(name, rows, f"divisible by nproc={nproc}: the ranks split it evenly "
                            f"(nproc = {fits} would)")
    _refuse(name, rows, f"divisible by {what}={parts}: it is cut into that many equal parts")


def _resolve(name: str, value, backend: str, resolving: str, device: str, count: int) -> str:
    """`launch.resolve_backend(resolving, count, device)`, its refusal naming parameter `name`."""
    try:
        return resolve_backend(resolving, count, device)
    except ValueError as err:
        others = [f"{k}={v!r}" for k, v in (("backend", backend), ("device", device)) if k != name]
        raise type(err)(f"parameter {name}={value!r} ({', '.join(others)}, {count} ranks): "
                        f"{err}") from None  # TooFewGPUs stays itself: gpu-check skips it


def check_parameters(nproc, backend="auto", device="auto", *, rank_bytes=RANK_BASE_BYTES,
                     divides=None, numbers=None, choices=None, ranks=None, min_nproc=1,
                     **sizes) -> str:
    """Refuse a notebook's parameters before any work; return the backend its launches use.

    nproc: an int >= 1, checked against this machine's cores and memory with `rank_bytes`
        a rank (`capacity.check_nproc`; `rank_bytes=None`: the notebook launches nothing).
    backend, device: one of BACKENDS, DEVICES; `device` decides the backend and is refused
        where the machine lacks it (`launch.resolve_backend(backend, nproc, device)`).
    divides: {name: rows} nproc must divide (a batch the ranks split), or {name: (rows,
        parts, "what the parts are")} where the rows are cut into more parts than ranks.
    numbers: {name: value} positive numbers (fractions allowed), or lists or dicts of them.
    choices: {name: (value, allowed)}.
    ranks: {name: count}: other launches' rank counts, checked as nproc is.
    min_nproc: the fewest ranks the notebook's claims hold on (TooFewRanks below it).
    sizes: every other parameter: a positive int, or a non-empty list or dict of them.

    `rank_bytes`, `divides` and `ranks` may be functions returning the value: they are called
    once every parameter's type is checked, so that what is computed from the parameters
    (`lambda: mlp_rank_bytes(width, depth, batch)`) never meets a string from `-r`.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int):
        _refuse("nproc", nproc, "an int >= 1, the number of ranks", TypeError)
    if nproc < 1:
        _refuse("nproc", nproc, "an int >= 1, the number of ranks")
    if nproc < min_nproc:
        _refuse("nproc", nproc, f"at least {min_nproc}: this notebook measures what ranks "
                "send each other, and one rank sends nothing (on one GPU, run it on CPU: "
                'device="cpu")', TooFewRanks)
    for name, value, allowed in (("backend", backend, BACKENDS), ("device", device, DEVICES),
                                 *((n, v, a) for n, (v, a) in (choices or {}).items())):
        if value not in allowed:
            _refuse(name, value, "one of " + ", ".join(map(repr, allowed)),
                    ValueError if isinstance(value, str) else TypeError)
    for name, value in sizes.items():
        _check_size(name, value)
    for name, value in (numbers or {}).items():
        _check_size(name, value, numbers=True)
    rank_bytes, divides, ranks = (x() if callable(x) else x for x in (rank_bytes, divides, ranks))
    for name, count in (ranks or {}).items():
        _check_size(name, count)
    for name, spec in (divides or {}).items():
        _check_divides(name, spec, nproc)

    # device, where it is set, decides the backend: name it; else the backend asked for
    asked = ("device", device) if device != "auto" else ("backend", backend)
    chosen = _resolve(*asked, backend, backend, device, nproc)
    for name, count in (ranks or {}).items():
        _resolve(name, count, backend, chosen, device, count)
    if rank_bytes is not None:
        capacity.check_nproc(nproc, rank_bytes, what="nproc", stacklevel=3)
        for name, count in (ranks or {}).items():
            capacity.check_nproc(count, rank_bytes, what=name, stacklevel=3)
    return chosen


def mlp_rank_bytes(width: int, depth: int, rows: int, models: int = 2) -> int:
    """What a rank training `depth` x Linear(width, width) on `rows` rows needs, estimated:
    RANK_BASE_BYTES (the interpreter, torch, a process group), 16 bytes a parameter (fp32
    weight, gradient, Adam's m and v, unsharded: the most any stage holds) for each of
    `models` models alive at once (the trained one and a one-process reference), and two fp32
    activations of rows x width a layer (the output saved for backward and its gradient)."""
    psi = depth * (width * width + width)
    return RANK_BASE_BYTES + models * 16 * psi + 2 * 4 * rows * width * depth


