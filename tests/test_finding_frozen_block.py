"""A wholly frozen block at stage 3, beside FSDP2 (issue 48, part 4, finding 1).

The course's stage 3 shards frozen parameters with the unit that trains beside them. A block
with no trainable parameter at all is no unit (units.plan_units drops units without trainable
parameters): its parameters join the root unit when the root trains a parameter of its own,
and otherwise stay whole on every rank. FSDP2's `fully_shard(block)` shards such a block like
any other (measured: 2 gloo ranks, a frozen Linear(64, 64) block; tests/workers/
finding_cases.py). So notebook 05 may say "sharded too, as in FSDP2" only of frozen
parameters inside a unit, and must say what becomes of a wholly frozen block.
"""

from __future__ import annotations

import re

import pytest
from common import finding_reports
from finding_text import markdown, sentences


@pytest.fixture(scope="module")
def reports() -> tuple[dict, ...]:
    return finding_reports("frozen")


def test_the_course_keeps_a_wholly_frozen_block_whole_or_in_the_root_unit(reports):
    for rep in reports:
        full = rep["numel"]
        # default: the head is a unit of its own, the root trains nothing: whole on every rank
        assert rep["course default"] == full
        assert rep["course default: units holding frozen parameters"] == []
        # unit_classes=[Block] leaves the head to the root: the frozen block joins the root
        assert rep["course unit_classes: units holding frozen parameters"] == ["(root)"]
        assert rep["course unit_classes"] < full
    assert sum(rep["course unit_classes"] for rep in reports) == reports[0]["numel"]


def test_fsdp2_shards_a_wholly_frozen_block_like_any_block(reports):
    for rep in reports:
        assert rep["fsdp2"] == rep["numel"] // 2


def frozen_block_sentences() -> list[str]:
    return [s for s in sentences(markdown("05"))
            if re.search(r"no trainable parameter|wholly frozen|all frozen", s)]


def test_notebook_05_says_what_becomes_of_a_wholly_frozen_block():
    found = " ".join(frozen_block_sentences())
    assert found, "notebook 05 never says what stage 3 does with a block that trains nothing"
    assert re.search(r"root unit", found), found
    assert re.search(r"whole on every rank", found), found
    assert re.search(r"FSDP2 shards", found), found


def test_no_sentence_says_every_frozen_parameter_is_sharded_as_in_fsdp2():
    text = markdown("05")
    stale = re.findall(r"Frozen parameters \(requires_grad=False\) are sharded too, as in FSDP2",
                       text)
    assert not stale, "frozen parameters are sharded with a unit only; a frozen block is not"
