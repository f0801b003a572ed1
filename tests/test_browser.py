"""The course as a learner meets it: notebooks run in JupyterLab, in a real (headless) browser.

Playwright for Python drives Debian's Chromium (never `playwright install`: its download
cannot work on the course's machines). One JupyterLab server and one browser serve every
scenario; each scenario opens its own page and ends its kernel. The helpers live in
tests/browser/: `server` (the server, and the proof that nothing it started is left),
`lab` (running cells, reading outputs), `calculator` (notebook 01's widget).

Where Chromium cannot be had the module skips with the reason; with CI=true it fails.
Failures leave a screenshot of the page in runs/browser/.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest
from browser import calculator, lab
from browser.server import LabServer

from zero_lab import grading

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "runs" / "browser"
PROBE = ROOT / "tests" / "workers" / "probe.py"
# A blank or single-colour image has variance ~0; a drawn bar chart has thousands.
MIN_CHART_VARIANCE = 100.0


def _chromium() -> str:
    """Chromium's path; else skip with the reason, or fail where CI=true requires the test."""
    ci = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

    def unavailable(why: str):
        if ci:
            pytest.fail(f"{why}; CI={os.environ['CI']} requires the browser test", pytrace=False)
        pytest.skip(why)

    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        unavailable("playwright is not installed (`make setup` installs the dev extras)")
    path = shutil.which("chromium")
    if path is None:
        unavailable("no `chromium` on PATH: `make test` installs Debian's with apt-get when "
                    "it runs as root; elsewhere install Chromium and put `chromium` on PATH")
    return path


@pytest.fixture(scope="module")
def chromium() -> str:
    return _chromium()


@pytest.fixture(scope="module")
def server(chromium, tmp_path_factory):
    """One JupyterLab for the module. Its teardown fails if any process it started is left."""
    OUT.mkdir(parents=True, exist_ok=True)
    lab_server = LabServer(ROOT, tmp_path_factory.mktemp("jupyter"), OUT / "jupyter-server.log")
    try:
        lab_server.start()
        yield lab_server
    finally:
        left = lab_server.stop()
        if left:
            pytest.fail("processes started by the browser test outlived it (now killed):\n"
                        + "\n".join(left), pytrace=False)


@pytest.fixture(scope="module")
def browser(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chrome = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield chrome
        chrome.close()


@pytest.fixture
def page(browser, server, request):
    """A fresh page; on failure a screenshot in runs/browser/; the scenario's kernel ends."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    new_page = context.new_page()
    new_page.set_default_timeout(30_000)
    failed_before = request.session.testsfailed
    yield new_page
    # The call phase's report is counted before function fixtures are torn down.
    if request.session.testsfailed > failed_before:
        new_page.screenshot(path=str(OUT / f"FAILED-{request.node.name}.png"), full_page=True)
    context.close()
    # Two cores: no idle torch kernel kept between scenarios. A server that no longer answers
    # is left to the `server` fixture, whose stop() ends and checks everything.
    with contextlib.suppress(OSError):
        server.shutdown_kernels()


def _not_run(page) -> list[str]:
    """'cell i: prompt' for each code cell without an execution count (none: all ran)."""
    return [f"cell {i}: {p}" for i, p in lab.prompts(page).items()
            if not re.fullmatch(r"\[\d+\]:", p.strip())]


# --------------------------------------------------------------------------- scenarios


def test_notebook01_runs_clean_and_the_calculator_answers_its_sliders(page, server):
    lab.open_notebook(page, server.url("notebooks/01_memory_accounting.ipynb"))
    lab.run_all(page, timeout_s=120)
    assert lab.error_outputs(page) == []
    assert _not_run(page) == []
    assert lab.wide_lines(page) == []

    calculator.wait_chart_loaded(page)
    chart, widget = page.locator(calculator.CHART), page.locator(
        ".jp-OutputArea-output", has=page.locator(calculator.CHART))
    assert lab.pixel_variance(chart) > MIN_CHART_VARIANCE, "the calculator's chart is blank"
    widget.screenshot(path=str(OUT / "01_calculator.png"))

    # The world size from 64 down to 1, one arrow at a time: stage 0 replicates everything
    # (its bytes stay), stages 1-3 divide something by N (their bytes grow as N falls).
    readings = [calculator.read(page)]
    assert readings[0].readouts["zero-lab-world-size"] == "64"
    for expected_n in (32, 16, 8, 4, 2, 1):
        now = calculator.press(page, "zero-lab-world-size", "ArrowLeft")
        before = readings[-1]
        assert now.readouts["zero-lab-world-size"] == str(expected_n)
        assert now.gib[0] == before.gib[0]
        assert all(now.gib[s] > before.gib[s] for s in (1, 2, 3)), (before.gib, now.gib)
        assert lab.pixel_variance(chart) > MIN_CHART_VARIANCE, f"blank chart at N = {expected_n}"
        readings.append(now)
    assert readings[0].fits != readings[-1].fits, "the verdict did not change from N=64 to 1"
    assert readings[0].fits[3] and not readings[-1].fits[3]  # 70B: stage 3 fits on 64 ranks

    # A bigger model: more bytes at every stage.
    bigger = calculator.press(page, "zero-lab-params", "ArrowRight")
    assert bigger.readouts["zero-lab-params"] != readings[-1].readouts["zero-lab-params"]
    assert "e+" not in bigger.readouts["zero-lab-params"]  # "175B", not 1.75e+11
    assert all(bigger.gib[s] > readings[-1].gib[s] for s in range(4))
    assert lab.pixel_variance(chart) > MIN_CHART_VARIANCE, "blank chart after Ψ changed"
    widget.screenshot(path=str(OUT / "01_calculator_after.png"))
    assert lab.error_outputs(page) == []


def test_notebook00_streams_rank0_output_while_the_cell_runs(page, server):
    lab.open_notebook(page, server.url("notebooks/00_setup.ipynb"))
    launch = lab.cell_index(page, 'torchrun("workers/hello_ranks.py"')
    for i in range(page.locator(lab.CELLS).count()):
        if i == launch:
            # Record, at the moment rank 0's line reaches the page, the cell's prompt: a
            # MutationObserver sees every change, where polling could miss a short window.
            page.evaluate(
                """(i) => {
                    const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
                    window.rank0Seen = null;
                    new MutationObserver(() => {
                        const out = cell.querySelector('.jp-OutputArea')?.innerText ?? '';
                        if (window.rank0Seen === null && out.includes('[rank0]')) {
                            window.rank0Seen = {
                                prompt: cell.querySelector('.jp-InputPrompt').textContent,
                                line: out.split('\\n').find(l => l.includes('[rank0]'))};
                        }
                    }).observe(cell, {subtree: true, childList: true, characterData: true});
                }""", i)
        lab.run_cell(page, i, timeout_s=90)
    seen = page.evaluate("window.rank0Seen")
    assert seen is not None, "rank 0's output never appeared in the launch cell"
    assert "*" in seen["prompt"], f"rank 0's line appeared only after the cell ended: {seen}"
    assert re.search(r"\[rank0\] rank 0/\d+ on \w+", seen["line"]), seen
    assert lab.error_outputs(page) == []
    # The course's rule for launch cells (STYLE.md): rank-prefixed lines, no warnings.
    assert lab.stderr_noise(page) == []
    assert _not_run(page) == []
    assert lab.wide_lines(page) == []


def test_student_copy_shows_the_graders_message_not_a_traceback(page, server):
    # What `make student` writes, with another --out: nothing shared is touched. In-process:
    # its command line is tests/test_grading.py's, and a fresh interpreter costs seconds.
    student = OUT / "student"
    grading.write_student_copies(ROOT / "notebooks", student)
    notebook = student / "03_zero1.ipynb"
    lab.open_notebook(page, server.url(notebook.relative_to(ROOT).as_posix()))
    exercise = lab.cell_index(page, "def owned_range(")
    check = lab.cell_index(page, "grading.check_owned_range(")
    assert "NotImplementedError" in page.locator(lab.CELLS).nth(exercise).inner_text()
    for i in range(check + 1):
        lab.run_cell(page, i, timeout_s=90)
    shown = _text(page, check)
    assert "check_owned_range: not implemented yet" in shown and "hint:" in shown, shown
    assert "Traceback" not in shown
    page.locator(lab.CELLS).nth(check).screenshot(path=str(OUT / "03_student_stub.png"))

    # The learner's first try: the floor of numel / N leaves the end unowned.
    editor = page.locator(lab.CELLS).nth(exercise).locator(".cm-content")
    editor.click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text("def owned_range(numel, world_size, rank):\n"
                              "    size = numel // world_size\n"
                              "    return rank * size, (rank + 1) * size\n")
    page.keyboard.press("Escape")
    lab.run_cell(page, exercise)
    lab.run_cell(page, check, timeout_s=90)
    shown = _text(page, check)
    assert re.search(r"expected .*\n\s*got", shown) and "hint:" in shown, shown
    assert "owned by no rank" in shown, shown  # the hint for exactly this mistake
    assert "Traceback" not in "\n".join(_text(page, i) for i in range(check + 1))
    page.locator(lab.CELLS).nth(check).screenshot(path=str(OUT / "03_student_check.png"))


def test_a_failing_rank_shows_its_traceback_and_the_kernel_survives(page, server):
    scratch = OUT / "launch_failure.ipynb"
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}})
    nb.cells = [
        nbformat.v4.new_code_cell("from zero_lab.launch import torchrun\n\n"
                                  f"torchrun({str(PROBE)!r}, nproc=2, args=['--fail-rank', '1'])"),
        nbformat.v4.new_code_cell("print('kernel still answers:', 6 * 7)"),
    ]
    nbformat.write(nb, scratch)
    lab.open_notebook(page, server.url(scratch.relative_to(ROOT).as_posix()))
    lab.run_cell(page, 0, timeout_s=90)
    shown = _text(page, 0)
    assert "LaunchError" in shown, shown
    assert "rank 1 of 2 failed in probe.py: ValueError: deliberate failure on rank 1" in shown
    assert 'probe.py", line' in shown  # the rank's own traceback, not only its last line
    page.locator(lab.CELLS).nth(0).screenshot(path=str(OUT / "launch_failure.png"))
    lab.run_cell(page, 1)
    assert "kernel still answers: 42" in _text(page, 1)


def test_a_question_commits_and_the_step_view_steps_through_recorded_ranks(page, server):
    """Issue 50's two widgets in a real page: a predict-then-observe question (Commit locks
    the pick; the reveal prints it beside the measured answer) and the step view over a
    2-rank launch's records (Next redraws the phase)."""
    scratch = OUT / "questions_and_step_view.ipynb"
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}})
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from zero_lab.course.questions import ask\n"
            "q = ask('Per step, ZeRO-1 sends ...', ['less than DDP', 'the same as DDP'])"),
        nbformat.v4.new_code_cell(
            "from zero_lab.course.step_view import step_view\n"
            "from zero_lab.launch import torchrun\n"
            "from zero_lab.launch.paths import WORKERS\n"
            "steps = torchrun(WORKERS / 'step_record.py', nproc=2, backend='gloo',\n"
            "                 stream=False).ranks\n"
            "view = step_view(steps, 'stage1')\n"
            "display(view)"),
        nbformat.v4.new_code_cell(
            "sent = {s: sum(p['message']['sent'] for p in steps[0]['systems'][s] "
            "if p['message'])\n        for s in ('ddp', 'stage1')}\n"
            "q.reveal('the same as DDP' if sent['stage1'] == sent['ddp'] else 'less than DDP',\n"
            "         why='a reduce-scatter and an all-gather send what one all-reduce does')"),
    ]
    nbformat.write(nb, scratch)
    lab.open_notebook(page, server.url(scratch.relative_to(ROOT).as_posix()))
    lab.run_cell(page, 0)
    question = page.locator(".zero-lab-question")
    question.get_by_text("the same as DDP").click()
    question.locator(".zero-lab-commit").click()
    page.locator(".zero-lab-committed").wait_for(timeout=10_000)
    assert "committed: the same as DDP" in question.inner_text()

    lab.run_cell(page, 1, timeout_s=90)
    title, image = page.locator(".zero-lab-step-title"), page.locator("img.zero-lab-step-image")
    assert "ZeRO-1, phase 1: backward" in title.inner_text()
    first = image.get_attribute("src")
    page.locator(".zero-lab-step-next").click()
    page.wait_for_function("(s) => !document.querySelector('.zero-lab-step-title')"
                           ".innerText.includes(s)", arg="phase 1:", timeout=20_000)
    assert "phase 2: reduce-scatter the gradient" in title.inner_text()
    page.wait_for_function("(s) => document.querySelector('img.zero-lab-step-image').src != s",
                           arg=first, timeout=20_000)
    assert lab.pixel_variance(image) > MIN_CHART_VARIANCE, "the step view's picture is blank"
    page.locator(lab.CELLS).nth(1).screenshot(path=str(OUT / "step_view.png"))

    lab.run_cell(page, 2)
    shown = _text(page, 2)
    assert "your prediction: the same as DDP · measured: the same as DDP · right" in shown, shown
    assert lab.error_outputs(page) == []


def test_nothing_started_by_the_browser_test_is_left(server):
    """Runs last: stops the server here (teardown would too) so a leftover fails a test."""
    assert server.stop() == []
    for name in ("00_setup.ipynb", "01_memory_accounting.ipynb"):  # autosave is off
        cells = json.loads((ROOT / "notebooks" / name).read_text())["cells"]
        assert all(not c.get("outputs") for c in cells), f"{name} was saved with outputs"


def _text(page, index: int) -> str:
    return "\n".join(o["text"] for o in lab.outputs(page, index))
