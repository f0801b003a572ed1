"""Driving a notebook in JupyterLab's page the way a learner does, and reading what it shows.

The habits are Galata's (JupyterLab's Playwright harness): wait until the kernel can take an
execution request before sending one, run through the menu or the keyboard, and call a run
finished when the status bar says Idle and the cells have their execution counts, never
after a sleep. Every wait is bounded.
"""

from __future__ import annotations

import io
import re
from typing import TYPE_CHECKING

from PIL import Image, ImageStat

if TYPE_CHECKING:  # the test skips, rather than fails to import, where playwright is missing
    from playwright.sync_api import Locator, Page

CELLS = ".jp-Notebook .jp-Cell"
STDERR = "application/vnd.jupyter.stderr"
SHOWN_AS_TEXT = ("application/vnd.jupyter.stdout", "text/plain")
# An error output and a stderr stream both render as STDERR; an error is what reads as one.
ERROR_TEXT = re.compile(r"Traceback \(most recent call last\)|^\w*(Error|Exception)\b",
                        re.MULTILINE)


def open_notebook(page: Page, url: str, timeout_s: float = 60) -> None:
    """Load the lab page on one notebook and wait until its kernel is started and idle."""
    page.goto(url)
    page.locator(CELLS).first.wait_for(timeout=timeout_s * 1000)
    dismiss_dialogs(page)
    wait_idle(page, timeout_s)


def dismiss_dialogs(page: Page) -> None:
    """Accept a kernel-selection (or any) dialog: the default is the notebook's own kernel."""
    dialog = page.locator(".jp-Dialog")
    if dialog.count():
        dialog.locator("button.jp-mod-accept").first.click()
        dialog.wait_for(state="detached")


def wait_idle(page: Page, timeout_s: float) -> None:
    """The kernel is idle (status bar) and no cell is running or queued (no `[*]` prompt).

    Galata's rule: a kernel still Starting or Connecting drops execution requests, so this is
    also what to wait for before running anything.
    """
    page.wait_for_function(
        """() => {
            const bar = document.querySelector('#jp-main-statusbar')?.textContent ?? '';
            const prompts = [...document.querySelectorAll('.jp-Notebook .jp-InputPrompt')];
            return bar.includes('| Idle') && !prompts.some(p => p.textContent.includes('*'));
        }""",
        timeout=timeout_s * 1000, polling=100)


def prompts(page: Page) -> dict[int, str]:
    """{cell index: prompt} of the code cells: '[3]:', '[*]:' (running or queued), '[ ]:'."""
    return dict(page.locator(CELLS).evaluate_all(
        """cells => cells.map((c, i) => [i, c.querySelector('.jp-InputPrompt')?.textContent])
                        .filter(([i, p], _) => cells[i].classList.contains('jp-CodeCell'))"""))


def run_all(page: Page, timeout_s: float) -> None:
    """Run > Run All Cells from the menu bar; return when every code cell has run.

    A cell that raises stops the queue and clears the later cells' [*]: that returns too,
    leaving those cells without a count (the caller's checks name them), not a timeout.
    """
    wait_idle(page, timeout_s)
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-item", has_text="Run All Cells").first.click()
    page.wait_for_function(  # started (or, for a tiny notebook, already over)
        """() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
                   .some(p => p.textContent.includes('*'))
                 || [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
                   .every(p => /\\[\\d+\\]/.test(p.textContent))""",
        timeout=10_000, polling=50)
    # Run All queues every code cell at once ([*]); none left means the run is over.
    wait_idle(page, timeout_s)


def run_cell(page: Page, index: int, timeout_s: float = 60) -> None:
    """Select cell `index` (of all cells) and run it from the keyboard, as a learner does.

    Return once a code cell has a new execution count and the kernel is idle (a markdown
    cell is rendered at once).
    """
    cell = page.locator(CELLS).nth(index)
    code = "jp-CodeCell" in (cell.get_attribute("class") or "")
    before = cell.locator(".jp-InputPrompt").inner_text() if code else ""
    wait_idle(page, timeout_s)
    cell.locator(".jp-InputArea-prompt").click()  # selects, in command mode
    # Ctrl+Enter runs in place; Shift+Enter on the last cell would append an empty one.
    page.keyboard.press("Control+Enter")
    if not code:
        return
    page.wait_for_function(
        """([i, before]) => {
            const p = document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
                .querySelector('.jp-InputPrompt').textContent;
            return /\\[\\d+\\]/.test(p) && p !== before;
        }""",
        arg=[index, before], timeout=timeout_s * 1000, polling=100)
    wait_idle(page, timeout_s)


def cell_index(page: Page, contains: str) -> int:
    """The index of the first cell whose source contains `contains` (found, not hard-coded)."""
    sources = page.locator(CELLS).evaluate_all(
        "cells => cells.map(c => c.querySelector('.jp-InputArea-editor')?.textContent ?? '')")
    found = [i for i, s in enumerate(sources) if contains in s]
    assert found, f"no cell contains {contains!r}: has the notebook changed?"
    return found[0]


def outputs(page: Page, index: int) -> list[dict]:
    """Cell `index`'s outputs as shown: [{"mime": data-mime-type, "text": visible text}]."""
    return page.locator(CELLS).nth(index).locator(".jp-OutputArea-output").evaluate_all(
        "els => els.map(e => ({mime: e.dataset.mimeType ?? '', text: e.innerText}))")


def error_outputs(page: Page) -> list[str]:
    """'cell i: text' for every output that reads as an error or a traceback.

    Harmless stderr (a library's warning) is not an error; a traceback or an
    `XxxError:` line is.
    """
    found = []
    for i in range(page.locator(CELLS).count()):
        for out in outputs(page, i):
            if out["mime"] == STDERR and ERROR_TEXT.search(out["text"]):
                found.append(f"cell {i}: {out['text'][:2000]}")
    return found


def wide_lines(page: Page) -> list[str]:
    """'cell i: (width) line' for every printed line wider than the course allows
    (zero_lab.course.runner.PRINT_WIDTH, the rule nbval holds the other notebooks to)."""
    from zero_lab.course.runner import PRINT_WIDTH

    return [f"cell {i}: ({len(line)}) {line}"
            for i in range(page.locator(CELLS).count()) for out in outputs(page, i)
            if out["mime"] in SHOWN_AS_TEXT
            for line in out["text"].split("\n") if len(line) > PRINT_WIDTH]


def stderr_noise(page: Page) -> list[str]:
    """'cell i: text' for stderr output that is not an error: what a learner sees as noise."""
    found = []
    for i in range(page.locator(CELLS).count()):
        for out in outputs(page, i):
            if out["mime"] == STDERR and not ERROR_TEXT.search(out["text"]):
                found.append(f"cell {i}: {out['text'][:300]}")
    return found


def pixel_variance(element: Locator) -> float:
    """Variance of the element's grey levels as screenshotted: 0 for a blank image."""
    element.scroll_into_view_if_needed()
    picture = Image.open(io.BytesIO(element.screenshot())).convert("L")
    return ImageStat.Stat(picture).var[0]
