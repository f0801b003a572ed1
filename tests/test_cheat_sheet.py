"""The page to keep (issue 48, part 3): the cheat sheet is what its generator writes from
memory.py and the collectives' volumes, never a hand edit; the glossary defines the course's
vocabulary, and the notebooks link to it. Pure Python: no launches, no torch process group."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from zero_lab import memory
from zero_lab.course import cheat_sheet, decision_plot, glossary_links, models
from zero_lab.predict import micro_batches

ROOT = Path(__file__).resolve().parent.parent
PRACTICE = ROOT / "zero_lab" / "practice"
GLOSSARY = PRACTICE / "glossary.md"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

# The course's vocabulary: each term must occur in the notebooks' markdown (so the list is
# the notebooks', not invented) and be a headword of the glossary.
TERMS = (
    "rank", "world size", "torchrun", "worker", "gloo", "NCCL", "lockstep",
    "mixed precision", "master weights", "reduce_dtype", "activation checkpointing",
    "recompute", "peak", "held", "offload",
    "all-reduce", "reduce-scatter", "all-gather", "broadcast", "ring", "algbw", "busbw",
    "direct exchange", "ledger",
    "flat buffer", "slice", "shard", "padding", "bucket", "unit", "reshard", "plain stage",
    "overlap", "exposed communication", "prefetch", "micro-batch", "accumulation", "MFU",
    "HSDP", "MiCS", "hpZ", "DTensor", "DCP", "fake process group",
)
# The notebooks' symbols: any of these written as a symbol in their markdown is a headword.
SYMBOLS = {"Ψ": r"Ψ", "K": r"(?<![\w-])K(?![\w-])", "N_d": r"\bN_d\b", "α": r"α", "β": r"β"}


def notebook_markdown(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def headwords(text: str) -> set[str]:
    """The bold terms that open a glossary entry ('- **rank** / **world size**: ...')."""
    found = set()
    for line in text.splitlines():
        line = re.sub(r'^- <a id="[\w-]+"></a>', "- ", line)  # the entry's anchor
        if line.startswith("- **"):
            head = line.split(":", 1)[0] if "**:" in line else line
            found |= {t.strip().casefold() for t in re.findall(r"\*\*(.+?)\*\*", head)}
    return found


def missing_terms(glossary: str, terms, symbols: dict, markdown: str) -> list[str]:
    heads = headwords(glossary)
    wanted = list(terms) + [s for s, pattern in symbols.items() if re.search(pattern, markdown)]
    return [t for t in wanted if t.casefold() not in heads]


# --------------------------------------------------------------------------- the cheat sheet


def test_the_committed_cheat_sheet_is_what_the_generator_writes():
    committed = (PRACTICE / "cheat_sheet.md").read_text(encoding="utf-8")
    assert committed == cheat_sheet.render(), (
        "zero_lab/practice/cheat_sheet.md is stale: run `python -m zero_lab.course.cheat_sheet`")


def test_the_page_shows_the_courses_numbers():
    page = cheat_sheet.render()
    assert "| 1 | 2Ψ + 2Ψ + 12Ψ/N = 4Ψ + 12Ψ/N | 2Ψ |" in page
    assert "| 3 | 2Ψ/N + 2Ψ/N + 12Ψ/N = 16Ψ/N | 3Ψ |" in page
    # the worked example: the course's Llama 3.1 8B on 8 GPUs
    assert "| Llama 3.1 8B on 8 GPUs |" in page
    assert f"{memory.model_state_bytes(models.PSI_8B, 3, 8)['total'] / memory.GiB:.1f} GiB" in page
    # three heads: five stages, the accumulation rows, the knobs
    assert page.count("\n| ") == 2 + 5 + 2 + len(micro_batches.HOW) + 2 + len(cheat_sheet.KNOBS)


def test_the_page_gives_the_accumulation_aware_rule_and_links_the_figure():
    """Issue 48: the rule recommend() keeps with k micro-batches, its numbers from
    knobs.accumulation_volume and recommend(), and the figure notebook 07 saves (committed)."""
    page = cheat_sheet.render()
    assert "| 2 | (k+1)Ψ | 9Ψ |" in page and "| 1 | 2Ψ | 2Ψ |" in page
    assert "at k = 8 stage 2 sends 4.5x stage 1's" in page
    assert "(Llama 3.1 8B on 8 x 80 GiB GPUs: stage 2 at k = 1, stage 1 at k = 8)" in page
    link = f"](../../figures/{decision_plot.NAME}.png)"
    assert link in page
    assert (ROOT / "figures" / f"{decision_plot.NAME}.png").is_file()
    nb07 = (ROOT / "notebooks" / "07_choosing_a_stage.ipynb").read_text(encoding="utf-8")
    assert 'save_figure(fig, decision_plot.NAME)' in nb07


def test_a_rule_that_ignores_accumulation_changes_the_page(monkeypatch):
    """Mutant: recommend() without accumulation (k passed as 1): the worked change is gone."""
    real = decision_plot.gpt_recommendation
    monkeypatch.setattr(decision_plot, "gpt_recommendation",
                        lambda n, g, accumulation=1, attention="fused": real(n, g, 1))
    assert "stage 2 at k = 1, stage 1 at k = 8" not in cheat_sheet.render()


def test_a_changed_formula_changes_the_page(monkeypatch):
    """Mutant: memory.py counting 4 bytes of optimizer per parameter fewer at stage 1."""
    before = cheat_sheet.render()
    real = memory.model_state_bytes

    def mutant(n_params, stage, world_size, *args, **kwargs):
        out = dict(real(n_params, stage, world_size, *args, **kwargs))
        if stage == 1:
            out["optimizer"] -= 4 * int(n_params) // world_size
            out["total"] = out["params"] + out["grads"] + out["optimizer"]
        return out

    monkeypatch.setattr(memory, "model_state_bytes", mutant)
    after = cheat_sheet.render()
    assert after != before
    assert "2Ψ + 2Ψ + 8Ψ/N = 4Ψ + 8Ψ/N" in after


def test_a_formula_not_linear_in_psi_over_n_is_refused(monkeypatch):
    real = memory.model_state_bytes
    monkeypatch.setattr(memory, "model_state_bytes", lambda n, s, w, *a, **k: {
        key: v + (w * w if key == "params" else 0) for key, v in real(n, s, w, *a, **k).items()})
    with pytest.raises(ValueError, match="not a·Ψ"):
        cheat_sheet.render()


def test_the_generator_writes_the_page(tmp_path):
    assert cheat_sheet.main([str(tmp_path / "page.md")]) == 0
    assert (tmp_path / "page.md").read_text(encoding="utf-8") == cheat_sheet.render()


# --------------------------------------------------------------------------- the glossary


def test_every_term_comes_from_the_notebooks():
    markdown = "\n".join(notebook_markdown(p) for p in NOTEBOOKS).casefold()
    assert [t for t in TERMS if t.casefold() not in markdown] == []


def test_the_glossary_defines_every_term_and_symbol():
    markdown = "\n".join(notebook_markdown(p) for p in NOTEBOOKS)
    glossary = GLOSSARY.read_text(encoding="utf-8")
    assert missing_terms(glossary, TERMS, SYMBOLS, markdown) == []
    assert {"Ψ", "K", "N_d"} <= {s for s, p in SYMBOLS.items() if re.search(p, markdown)}


def test_a_deleted_entry_is_caught():
    """Mutant: the glossary without its 'bucket' and 'Ψ' lines."""
    markdown = "\n".join(notebook_markdown(p) for p in NOTEBOOKS)
    glossary = "\n".join(line for line in GLOSSARY.read_text(encoding="utf-8").splitlines()
                         if not re.match(r'- <a id="(bucket|psi)">', line))
    assert missing_terms(glossary, TERMS, SYMBOLS, markdown) == ["bucket", "Ψ"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_links_to_the_glossary(path):
    assert "](../zero_lab/practice/glossary.md)" in notebook_markdown(path)


def test_every_glossary_entry_has_an_anchor():
    lines = [ln for ln in GLOSSARY.read_text(encoding="utf-8").splitlines() if ln.startswith("- ")]
    assert [ln[:40] for ln in lines if not glossary_links.ENTRY.match(ln)] == []
    # Ψ's, K's, N_d's and α-β's entries name symbols, which sit in formulas: never linked
    assert len(set(glossary_links.entries().values())) == len(lines) - 4


def test_each_term_links_to_its_entry_where_the_course_first_uses_it():
    assert glossary_links.link_course(write=False) == [], (
        "python -m zero_lab.course.glossary_links")


def test_the_link_goes_to_the_first_use_outside_code_and_headings():
    """Mutants: a notebook's link to 'bucket' removed (it is put back at the first use); a
    term linked inside a heading or code span; a second use linked again."""
    target = "../zero_lab/practice/glossary.md#bucket"
    cells = ["## One bucket", "A `bucket` in code, then Buckets in prose.", "A bucket again."]
    linked = glossary_links.link_cells(cells, {"bucket": "bucket"})
    assert linked == ["## One bucket", f"A `bucket` in code, then [Buckets]({target}) in prose.",
                      "A bucket again."]
    assert glossary_links.link_cells(linked, {"bucket": "bucket"}) == linked
    assert glossary_links.link_cells(["NCCL and nccl"], {"NCCL": "gloo"}) == [
        "[NCCL](../zero_lab/practice/glossary.md#gloo) and nccl"]
    path = NOTEBOOKS[1]  # 01: the course's first 'bucket' is its link
    prose = ["".join(c["source"]) for c in json.loads(path.read_text(encoding="utf-8"))["cells"]
             if c["cell_type"] == "markdown"]
    unlinked = [re.sub(rf"\[([^\]]*)\]\({re.escape(target)}\)", r"\1", c) for c in prose]
    assert unlinked != prose
    assert glossary_links.link_cells(unlinked, {"bucket": "bucket"}) == prose


def test_the_pages_link_each_other():
    assert "](cheat_sheet.md)" in GLOSSARY.read_text(encoding="utf-8")
    assert "](glossary.md)" in cheat_sheet.render()
