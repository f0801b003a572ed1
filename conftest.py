"""nbval's notebooks are held to the course's printed width: a cell that prints a line wider
than zero_lab.course.runner.PRINT_WIDTH fails, naming the line (issue 35: every line a learner reads
fits the screen). Here at the repository root so it reaches the notebooks nbval collects;
the tests in tests/ have their own conftest.py."""

from __future__ import annotations

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    outputs = getattr(item, "test_outputs", None)  # set by nbval's cell items as they run
    if outputs is not None and type(item).__name__ == "IPyNbCell":
        from zero_lab.course.runner import PRINT_WIDTH, wide_lines

        wide = wide_lines(outputs)
        if wide:
            listed = "\n".join(f"  ({len(line)}) {line}" for line in wide[:5])
            raise AssertionError(f"{len(wide)} printed lines over {PRINT_WIDTH} characters:\n"
                                 f"{listed}")
    return result
