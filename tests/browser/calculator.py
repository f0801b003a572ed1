"""Notebook 01's memory calculator as the page shows it, through the classes the widget sets.

The contract (zero_lab/course/widgets.py): the chart is an ipywidgets Image whose <img> has class
`zero-lab-chart`; the verdict is an HTML widget of class `zero-lab-verdict` with one line per
stage, "stage 2: 41.23 GiB per rank -> does NOT fit" or "-> fits"; the world size is a
SelectionSlider of class `zero-lab-world-size`, the parameter count one of class
`zero-lab-params`. Everything here reads the page; nothing asks the kernel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

CHART = "img.zero-lab-chart"
VERDICT = ".zero-lab-verdict"
STAGE_LINE = re.compile(r"^stage (\d): ([\d.,]+) GiB per rank -> (fits|does NOT fit)$",
                        re.MULTILINE)


@dataclass(frozen=True)
class Reading:
    """What the calculator shows at one moment."""

    readouts: dict[str, str]  # slider class -> its readout ("64", "70B")
    gib: dict[int, float]  # stage -> GiB per rank
    fits: dict[int, bool]  # stage -> the verdict
    chart_src: str  # a new blob: URL each time the kernel sends a new PNG


def read(page: Page) -> Reading:
    text = page.locator(VERDICT).inner_text()
    lines = STAGE_LINE.findall(text)
    assert [int(s) for s, _, _ in lines] == [0, 1, 2, 3], f"verdict lines not found in:\n{text}"
    return Reading(
        readouts={c: page.locator(f".{c} .widget-readout").inner_text().strip()
                  for c in ("zero-lab-params", "zero-lab-world-size")},
        gib={int(s): float(g.replace(",", "")) for s, g, _ in lines},
        fits={int(s): v == "fits" for s, _, v in lines},
        chart_src=page.locator(CHART).get_attribute("src") or "",
    )


def wait_chart_loaded(page: Page, timeout_s: float = 20) -> None:
    """The <img> has decoded its current PNG (a screenshot before that would be empty)."""
    page.wait_for_function(
        "(sel) => { const i = document.querySelector(sel);"
        " return i !== null && i.complete && i.naturalWidth > 0; }",
        arg=CHART, timeout=timeout_s * 1000, polling=50)


def press(page: Page, slider_class: str, key: str, timeout_s: float = 30) -> Reading:
    """Press `key` on a slider's handle, as a keyboard user does; return the new reading.

    The kernel answers a change with a new chart and a new verdict (two messages): wait for
    both to differ from before, and for the new image to be decoded.
    """
    before, text_before = read(page), page.locator(VERDICT).inner_text()
    handle: Locator = page.locator(f".{slider_class} .noUi-handle")
    handle.focus()
    handle.press(key)
    page.wait_for_function(
        """([verdict, chart, text, src]) => {
            const v = document.querySelector(verdict)?.innerText ?? '';
            const c = document.querySelector(chart)?.getAttribute('src') ?? '';
            return v !== text && c !== src;
        }""",
        arg=[VERDICT, CHART, text_before, before.chart_src],
        timeout=timeout_s * 1000, polling=50)
    wait_chart_loaded(page, timeout_s)
    return read(page)
