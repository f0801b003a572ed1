"""One model carried through the course (issue 50, part 1): every notebook that trains an MLP
trains the course MLP (zero_lab/course/models.py), every transformer it trains on the CPU is
the course GPT, and every projection prices Llama 3.1 8B or Llama 3 70B, so a number the
learner met in one notebook comes back in the next. Pure Python: reads the notebooks' JSON."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from zero_lab.course import models

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

# A model size written as a literal in code: 7e9, 1.5e9, 70e9 ... (not a unit's 1e9 or 1e12,
# not a conversion's "/ 1e9" or "* 1e9").
SIZE_LITERAL = re.compile(r"(?<![\w.])(?<!/ )(?<!\* )(?!1e9\b|1e12\b)\d+(?:\.\d+)?e(?:9|1[0-2])\b")
# A model size in prose: "7B", "13B", "1.5B" (not "80 GB", not "8B-token").
SIZE_WORD = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)B\b(?!-token)")
AT_SCALE_WORDS = {"8B", "70B", "8.03B", "70.6B", "70.55B"}

# Sizes a notebook quotes from a source it examines, never one it projects with: each says
# whose number it is. Anything else is a projection and must use models.AT_SCALE.
QUOTED = {
    "02_collectives": {
        "300e9": "a link's bandwidth, not a model", "450e9": "a link's bandwidth, not a model",
    },
    "05_zero3": {
        "2.289B": "the blog's claimed Ψ, which the notebook examines",
        "2.289e9": "the blog's claimed Ψ, which the notebook examines",
        "18.3e9": "the blog's claimed bytes, which the notebook examines",
    },
    "07_choosing_a_stage": {
        "3.35e12": "an H100's HBM bandwidth, not a model",
        "100B": "the rule of thumb it tests: 'ZeRO-3's ~10-20% at 100B+ parameters'",
    },
    "01_memory_accounting": {
        "1.5B": "the ZeRO paper's GPT-2 example (its section 3)",
        "1.5e9": "the ZeRO paper's GPT-2 example (its section 3)",
        "7.5B": "the ZeRO paper's Figure 1 model",
        "7.5e9": "the ZeRO paper's Figure 1 model",
        "7.6B": "the ZeRO paper's Table 2, as printed",
        "121.6B": "the ZeRO paper's Table 2, as printed",
        "122.3B": "the ZeRO paper's Table 2, unrounded",
        "6.2B": "the ZeRO paper's Table 2, measured",
    },
}


def cells(path: Path, kind: str) -> list[str]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


def parameters_cell(path: Path) -> str:
    nb = json.loads(path.read_text(encoding="utf-8"))
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: one cell tagged 'parameters'"
    return "".join(tagged[0]["source"])


def sizes_set(source: str) -> dict[str, object]:
    """name -> literal value for every width/depth the parameters cell sets, dict keys
    included ('mlp["width"]'); GPT dicts are reported under 'gpt[...]'."""
    found: dict[str, object] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assign) or not isinstance(node.targets[0], ast.Name):
            continue
        name = node.targets[0].id
        if isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                if isinstance(key, ast.Constant):
                    found[f"{name}[{key.value!r}]"] = ast.literal_eval(value)
        elif re.search(r"(width|depth)$", name):
            found[name] = ast.literal_eval(node.value)
    return found


def wrong_sizes(found: dict[str, object]) -> list[str]:
    """The settings that are not the course MLP's or the course GPT's."""
    gpt = {"width": models.GPT["d_model"], "d_model": models.GPT["d_model"],
           "layers": models.GPT["n_layers"], "depth": models.GPT["n_layers"],
           "n_layers": models.GPT["n_layers"], "heads": models.GPT["n_heads"],
           "seq": models.GPT["seq_len"], "vocab": models.GPT["vocab_size"]}
    wrong = []
    for name, value in found.items():
        key = re.search(r"\['(\w+)'\]$", name)
        if name.startswith("gpt["):
            if key and key.group(1) in gpt and value != gpt[key.group(1)]:
                wrong.append(f"{name} = {value!r} (the course GPT: {gpt[key.group(1)]})")
            continue
        field = key.group(1) if key else name
        if field.endswith("width") and value != models.WIDTH:
            wrong.append(f"{name} = {value!r} (the course MLP: width {models.WIDTH})")
        elif field.endswith("depth") and value != models.DEPTH:
            wrong.append(f"{name} = {value!r} (the course MLP: depth {models.DEPTH})")
    return wrong


def unnamed_sizes(path: Path) -> list[str]:
    """Model sizes a notebook writes that are neither the at-scale models nor quoted."""
    quoted = QUOTED.get(path.stem, {})
    code = "\n".join(cells(path, "code"))
    prose = "\n".join(cells(path, "markdown"))
    found = SIZE_LITERAL.findall(code) + [m.group(0) for m in SIZE_WORD.finditer(prose)]
    return sorted({s for s in found if s not in quoted and s not in AT_SCALE_WORDS})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_trains_the_course_models(path):
    assert wrong_sizes(sizes_set(parameters_cell(path))) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_projection_prices_the_at_scale_models(path):
    assert unnamed_sizes(path) == []


def test_every_quote_allowed_is_still_quoted():
    """An allowance the notebook no longer needs would let that size back in unseen."""
    unused = {}
    for stem, quotes in QUOTED.items():
        path = ROOT / "notebooks" / f"{stem}.ipynb"
        text = "\n".join(cells(path, "code") + cells(path, "markdown"))
        unused[stem] = [q for q in quotes if q not in text]
    assert unused == {stem: [] for stem in QUOTED}


def test_the_checks_catch_another_model():
    """Mutants: notebook 05's old width 256; a GPT of width 64; a 13B projection."""
    assert wrong_sizes(sizes_set("width = 256\ndepth = 6\n")) == [
        "width = 256 (the course MLP: width 1024)"]
    assert wrong_sizes(sizes_set('gpt = {"width": 64, "seq": 16}\n')) == [
        "gpt['width'] = 64 (the course GPT: 32)"]
    assert wrong_sizes(sizes_set('mlp = {"width": 1024, "depth": 4}\n')) == [
        "mlp['depth'] = 4 (the course MLP: depth 6)"]
    assert SIZE_LITERAL.findall("recommend(13e9, 8) / 1e9 * 1e9 + 1e12") == ["13e9"]
    assert [m.group(0) for m in SIZE_WORD.finditer("a 13B model, 80 GB, 15T-token")] == ["13B"]


def test_the_at_scale_models_are_the_published_ones():
    assert models.PSI_MLP == 6_297_600
    assert models.PSI_8B == 8_030_261_248    # Llama 3.1 8B's model card: 8.03B
    assert models.PSI_70B == 70_553_706_496  # Llama 3 70B: 70.6B
