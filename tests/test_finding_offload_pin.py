"""FSDP2's CPUOffloadPolicy on CPU-only ranks (issue 48, part 4, finding 3).

FSDP2 refuses CPU-only training with `CPUOffloadPolicy()` only because its default
`pin_memory=True` pins the sharded parameters (torch 2.13 _fsdp_param.py: `.pin_memory()`,
"Cannot access accelerator device when none is available"); `CPUOffloadPolicy(pin_memory=
False)` trains on gloo, to the same weights as without offload (measured: 2 ranks, 3 Adam
steps, tests/workers/finding_cases.py). Notebook 09 must say so, not that FSDP2 refuses CPU.
"""

from __future__ import annotations

import re

import pytest
from common import finding_reports
from finding_text import markdown, sentences


@pytest.fixture(scope="module")
def reports() -> tuple[dict, ...]:
    return finding_reports("offload")


def test_pinned_offload_is_refused_on_cpu_and_unpinned_offload_trains(reports):
    for rep in reports:
        assert "Cannot access accelerator device" in rep["pinned"], rep["pinned"]
        assert rep["moved"] > 1e-3  # the weights trained
        assert rep["max_diff"] == 0.0  # as without offload


def offload_sentences() -> list[str]:
    return [s for s in sentences(markdown("09")) if "CPUOffloadPolicy" in s]


def test_notebook_09_names_pin_memory_as_what_needs_an_accelerator():
    said = " ".join(offload_sentences())
    assert re.search(r"pin_memory=True", said), said
    assert re.search(r"pin_memory=False", said), said


def test_notebook_09_does_not_say_fsdp2_refuses_cpu_offload_on_cpu():
    stale = [s for s in offload_sentences()
             if re.search(r"on CPU, FSDP2 refuses|;\s*it needs an accelerator", s)]
    assert not stale, stale
