"""The package's layout rules, read from the source (nothing is imported or run).

One home for each side of a launch (see zero_lab/__init__.py):
- the *parent side* (notebook kernels, `zero_lab.grading`, the bench command, plots, the
  course runner, widgets) never imports a *rank script* (`zero_lab/workers/`, the cells a
  notebook writes with %%rank_script or %%writefile, tests/workers/);
- a rank script, and every *shared* module (all the rest of zero_lab), never imports
  parent-only code; rank scripts import shared modules only, never each other.
Imports inside functions count: a lazy import runs on the side that calls it.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "zero_lab"

PARENT_ONLY = ("zero_lab.grading", "zero_lab.course.bench", "zero_lab.course.plots",
               "zero_lab.course.trace_plots", "zero_lab.course.scaling_plots",
               "zero_lab.course.knob_plots", "zero_lab.course.layout_plots",
               "zero_lab.course.step_view", "zero_lab.course.glossary_links",
               "zero_lab.course.figure_sources",
               "zero_lab.course.runner", "zero_lab.course.__main__", "zero_lab.course.soak",
               "zero_lab.course.widgets", "zero_lab.course.gpu_check")
RANK_SIDE = "zero_lab.workers"
# Rank scripts that run other rank scripts' parts in their own launch (one torchrun start-up
# instead of several on a 2-core machine); each part still runs alone as its own script.
RANK_IMPORTS_ALLOWED = {
    ("zero_lab.workers.knobs_demo", "zero_lab.workers.knob_accumulation"),
    ("zero_lab.workers.knobs_demo", "zero_lab.workers.knob_recompute_precision"),
}

# Modules longer than ~400 lines, each one idea read top to bottom.
LONG_MODULES = {
    "zero_lab/memory.py": "the calculators, in the order notebook 01 teaches them; "
                                  "no torch",
    "zero_lab/course/plots.py": "one figure function per notebook section, in course order",
    "zero_lab/stages/zero3.py": "stage 3 read top to bottom: one step's hooks, in order, with "
                                "prefetch and reshard_after_forward woven through them",
}
MAX_LINES = 400


def _within(module: str, roots: tuple[str, ...] | str) -> bool:
    roots = (roots,) if isinstance(roots, str) else roots
    return any(module == r or module.startswith(r + ".") for r in roots)


def side(module: str) -> str:
    if _within(module, RANK_SIDE):
        return "rank"
    if _within(module, PARENT_ONLY):
        return "parent"
    return "shared"


def import_targets(source: str, known: set[str]) -> set[str]:
    """The modules `source` names in its imports, each by its own name, lazy imports too:
    `from zero_lab import grading` is the submodule zero_lab.grading, `from zero_lab.stages
    import shard` the package zero_lab.stages."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known
                         else node.module for alias in node.names)
    return found


def imported_modules(source: str, known: set[str]) -> set[str]:
    """Every zero_lab module `source` imports (a package's __init__ runs too)."""
    found: set[str] = set()
    for name in import_targets(source, known):
        if name == "zero_lab" or name.startswith("zero_lab."):
            parts = name.split(".")
            found.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    return found


def violations(sources: dict[str, tuple[str, str]], known: set[str]) -> list[str]:
    """The broken rules, one line each. `sources`: {where: (side, source code)}."""
    broken = []
    for where, (own_side, source) in sources.items():
        for target in sorted(imported_modules(source, known)):
            target_side = side(target)
            if (where, target) in RANK_IMPORTS_ALLOWED:
                continue
            if target_side == "rank" and target != RANK_SIDE or (
                    target == RANK_SIDE and own_side != "rank"):
                broken.append(f"{where} ({own_side}) imports the rank script {target}")
            elif own_side != "parent" and target_side == "parent":
                broken.append(f"{where} ({own_side}) imports parent-only {target}")
    return broken


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_sources() -> dict[str, tuple[str, str]]:
    return {_module_name(p): (side(_module_name(p)), p.read_text())
            for p in sorted(PACKAGE.rglob("*.py"))}


def _notebook_sources() -> dict[str, tuple[str, str]]:
    """Kernel cells are parent side; cells that write a worker script (%%rank_script, from
    zero_lab.launch, or %%writefile) are the rank scripts they write."""
    out = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] != "code":
                continue
            lines = "".join(cell["source"]).splitlines()
            writes = bool(lines) and lines[0].startswith(("%%rank_script", "%%writefile"))
            code = "\n".join(ln for ln in lines if not ln.lstrip().startswith(("%", "!")))
            out[f"{path.name} cell {i}"] = ("rank" if writes else "parent", code)
    return out


def _test_worker_sources() -> dict[str, tuple[str, str]]:
    return {f"tests/workers/{p.name}": ("rank", p.read_text())
            for p in sorted((ROOT / "tests" / "workers").glob("*.py"))}


KNOWN = set(_package_sources())


def test_the_sides_name_real_modules():
    sides = {name: s for name, (s, _) in _package_sources().items()}
    assert set(PARENT_ONLY) <= set(sides), "PARENT_ONLY names a module that does not exist"
    assert RANK_SIDE in sides and sides["zero_lab.stages"] == "shared"


def test_the_package_keeps_the_two_sides_apart():
    assert violations(_package_sources(), KNOWN) == []


def test_notebooks_keep_the_two_sides_apart():
    assert violations(_notebook_sources(), KNOWN) == []


def test_cells_that_write_rank_scripts_are_rank_side():
    # Notebook 00 writes its three worker scripts from cells (%%rank_script, or %%writefile).
    setup = {where: s for where, (s, _) in _notebook_sources().items()
             if where.startswith("00_setup.ipynb")}
    assert list(setup.values()).count("rank") == 3


def test_test_workers_import_no_parent_code():
    assert violations(_test_worker_sources(), KNOWN) == []


@pytest.mark.parametrize("where, own_side, source, expected", [
    ("zero_lab.workers.new", "rank", "from zero_lab import grading", "imports parent-only"),
    ("zero_lab.workers.new", "rank", "def f():\n    from zero_lab.course.bench import run",
     "imports parent-only zero_lab.course.bench"),
    ("zero_lab.workers.new", "rank", "from zero_lab.workers.bench_worker import Run",
     "imports the rank script"),
    ("zero_lab.grading.new", "parent", "from zero_lab.workers.zero3_exercises import CASES",
     "imports the rank script"),
    ("zero_lab.stages.partition", "shared", "import zero_lab.course.plots", "imports parent-only"),
    ("notebook cell", "parent", "import zero_lab.workers", "imports the rank script"),
])
def test_a_forbidden_import_is_caught(where, own_side, source, expected):
    lines = violations({where: (own_side, source)}, KNOWN)
    assert lines and all(expected in line for line in lines), lines


def test_allowed_imports_pass():
    assert violations({"zero_lab.workers.new": ("rank", "from zero_lab.stages import shard\n"
                                                        "from zero_lab.course import exercises")},
                      KNOWN) == []
    assert violations({"zero_lab.grading.new": ("parent",
                                                 "from zero_lab.launch.paths import WORKERS")},
                      KNOWN) == []


def test_modules_stay_small_or_say_why():
    long = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
            for p in PACKAGE.rglob("*.py")}
    too_long = {p: n for p, n in long.items() if n > MAX_LINES and p not in LONG_MODULES}
    assert too_long == {}, "split these modules, or add them to LONG_MODULES with the reason"


def test_the_tests_import_their_shared_launches_one_way():
    """tests/common.py caches one launch per (worker, world size); imported as `tests.common`
    beside `common` it is a second module with a second cache, and every world_cases launch
    runs twice (measured: +163 s of a clean `make test` on 2 cores)."""
    twice = [p.name for p in (ROOT / "tests").glob("test_*.py")
             if any(line.startswith(("from tests.common ", "import tests.common"))
                    for line in p.read_text().splitlines())]
    assert twice == [], f"import common, not tests.common, in {twice}"


def import_graph(sources: dict[str, tuple[str, str]], known: set[str]) -> dict[str, set[str]]:
    """module -> the zero_lab modules it imports, each by its own name (a package's name only
    when the package itself is imported), lazy imports included."""
    return {where: {name for name in import_targets(source, known)
                    if name in known and name != where}
            for where, (_, source) in sources.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, each once, as the modules around it (depth-first search)."""
    found, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            loop = path[path.index(module):]
            if frozenset(loop) not in done:
                done.add(frozenset(loop))
                found.append(loop)
            return
        for target in sorted(graph.get(module, ())):
            visit(target, path + [module])

    for module in sorted(graph):
        visit(module, [])
    return found


def test_no_module_imports_itself_round_a_circle():
    """collectives' cost model -> exchange -> ledger -> the cost model was one (a lazy import
    hid it); a reader follows imports down, never round."""
    assert circles(import_graph(_package_sources(), KNOWN)) == []


def test_a_circle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
