"""Numbers as a reader takes them in: bar labels and model sizes, never 1.05e+03.

Shared by the figures (`plots`), the memory calculator (`widgets`) and the tables of
measured times (`bench`, `grading/nb08_knobs_tables`).
"""

from __future__ import annotations

import statistics
from collections.abc import Collection


def readable_number(value: float) -> str:
    """1,053 / 41.2 / 3.07 / 0.004: as many decimals as the size of the value needs."""
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 0.01 or value == 0:
        return f"{value:.2f}"
    return f"{value:.1g}"


def model_size(n_params: float) -> str:
    """A parameter count as people say it: 125M, 1.3B, 70B, 1T (three significant digits)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n_params >= scale:
            return f"{n_params / scale:.3g}{unit}"
    return f"{n_params:.0f}"


def spread(values: list[float], decimals: int) -> str:
    """Repeated measurements as 'median (min-max)': a spread, never a single number."""
    return (f"{statistics.median(values):.{decimals}f} "
            f"({min(values):.{decimals}f}-{max(values):.{decimals}f})")


def table(rows: list[dict], right: Collection[str] = ()) -> str:
    """Rows of equal keys as a fixed-width text table: a header of the keys, numbers right-
    aligned with thousands separators, text left-aligned but in the columns named `right`
    (numbers the caller formatted)."""
    if not rows:
        return "(no rows)"
    keys = list(rows[0])
    cells = [[f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)
              for v in (row[k] for k in keys)] for row in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    numeric = [k in right or all(isinstance(r[k], int | float) and not isinstance(r[k], bool)
                                 for r in rows) for k in keys]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric, strict=True)).rstrip()

    head = line(keys)
    return "\n".join([head, "-" * len(head), *(line(c) for c in cells)])
