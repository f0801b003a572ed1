"""Predict, then observe: a question the learner answers before the cell that measures it.

    q = ask("Stage 1 replaces DDP's all-reduce. Per step, each rank sends ...",
            ["less than DDP", "the same as DDP", "more than DDP"])
    ... the cells that measure it ...
    q.reveal("the same as DDP", why="a reduce-scatter and an all-gather are one all-reduce")

    q = ask("How many MiB does one rank hold at N = 8?", number=True)
    q.reveal(held / MiB, why="...")          # their number beside the measured one

`ask` shows the choices (or a number box) and a Commit button; committing locks the answer,
so the measured value cannot change it. `reveal` prints the learner's answer beside the
measured one, whether they match, and why, as plain text: the same lines in JupyterLab, under
nbval and in a papermill run, where nobody clicks and the answer shows as not committed.

The answers stay in the kernel that asked: nothing is written to disk, nothing reaches the
batch grader. A prediction is worth making only when a wrong one costs nothing; counting them
for an instructor would turn them into a test the learner games by running ahead.

The arithmetic of a verdict is a plain function (`verdict`), tested without a browser; the
widget only wires controls to it. tests/test_browser.py clicks one in a real page through its
CSS classes (zero-lab-question, zero-lab-commit, zero-lab-committed).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

CLOSE = 0.25  # a number within 25% of the measured one counts as right: orders of magnitude
WIDTH = 100  # printed lines wrap here (the notebooks keep every printed line within 110)


def verdict(picked: str | float | None, answer: str | float, why: str,
            number: bool = False) -> list[str]:
    """The lines `reveal` prints: the learner's answer, the measured one, and why."""
    if number:
        measured = f"{answer:,.4g}"
        if picked is None:
            head = f"measured: {measured} (no prediction committed)"
        else:
            ratio = picked / answer if answer else math.inf
            close = answer != 0 and abs(ratio - 1) <= CLOSE
            head = (f"your prediction: {picked:,.4g} · measured: {measured} · "
                    + ("right (within 25%)" if close else f"off by {ratio:.3g}x"))
    elif picked is None:
        head = f"measured: {answer} (no prediction committed)"
    else:
        head = (f"your prediction: {picked} · measured: {answer} · "
                + ("right" if picked == answer else "not this time"))
    return [*textwrap.wrap(head, WIDTH, subsequent_indent="  "),
            *textwrap.wrap(f"why: {why}", WIDTH, subsequent_indent="  ")]


class Question:
    """One question: its controls while it is open, the committed answer after."""

    def __init__(self, text: str, choices: Sequence[str] | None = None,
                 number: bool = False) -> None:
        if number == bool(choices):
            raise ValueError("a question takes either choices or number=True, not both "
                             f"nor neither (got choices={choices!r}, number={number})")
        if choices is not None and len(set(choices)) != len(choices):
            raise ValueError(f"choices repeat one another: {list(choices)!r}")
        self.text, self.choices, self.number = text, list(choices or []), number
        self.committed: str | float | None = None
        self._widget = None

    def commit(self, value: str | float) -> None:
        """Lock `value` in as the prediction (the Commit button calls this)."""
        if self.committed is not None:
            return  # the first answer stands
        if self.number:
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"a prediction must be a finite number, got {value!r}")
        elif value not in self.choices:
            raise ValueError(f"{value!r} is not one of the choices {self.choices!r}")
        self.committed = value

    def reveal(self, answer: str | float, why: str) -> None:
        """Print the prediction beside the measured `answer`, and `why`."""
        if not self.number and answer not in self.choices:
            raise ValueError(f"the measured answer {answer!r} is not one of the choices "
                             f"{self.choices!r}")
        for line in verdict(self.committed, answer, why, self.number):
            print(line)

    def widget(self):
        """The controls: the choices (or a number box), Commit, and a line saying what holds."""
        import ipywidgets as w

        if self.number:
            entry = w.FloatText(value=0.0, description="your answer:",
                                style={"description_width": "initial"})
        else:
            entry = w.RadioButtons(options=self.choices, value=None,
                                   layout=w.Layout(width="max-content"))
        button = w.Button(description="Commit", button_style="primary")
        button.add_class("zero-lab-commit")
        status = w.HTML("<i>commit an answer, then run the next cells</i>")

        def on_commit(_):
            if entry.value is None:
                status.value = "<i>pick one first</i>"
                return
            self.commit(entry.value)
            entry.disabled = button.disabled = True
            status.value = f"committed: <b>{self.committed}</b>"
            status.add_class("zero-lab-committed")

        button.on_click(on_commit)
        box = w.VBox([w.HTML(f"<b>Predict.</b> {self.text}"), entry, w.HBox([button, status])])
        box.add_class("zero-lab-question")
        self._widget = box
        return box


def ask(text: str, choices: Sequence[str] | None = None, number: bool = False) -> Question:
    """Show a question before the cell that measures its answer; keep what it returns for
    `reveal`. Outside a notebook (no IPython kernel) its text is printed instead."""
    question = Question(text, choices, number)
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(question.widget())
    else:
        listed = f" ({' / '.join(question.choices)})" if question.choices else ""
        print(textwrap.fill(f"Predict: {text}{listed}", WIDTH, subsequent_indent="  "))
    return question
