"""The two READMEs, kept true (issue 36, part 4): the course README stays short, the package
guide (zero_lab/README.md) names every module and package, and no path or dotted module either
of them names is stale after a move. Plain text checks: no imports of zero_lab, no launches."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "zero_lab"
README = ROOT / "README.md"
GUIDE = PKG / "README.md"
MAX_README_BYTES = 15_000
MAX_MAP_ROW = 300
MAX_TOP_LEVEL = 15  # 12 packages, __init__.py, the guide, memory.py (the public API)

PATH = re.compile(r"\bzero_lab/[\w/]*\w\.py\b")  # zero_lab/memory.py
DOTTED = re.compile(r"\bzero_lab(?:\.[A-Za-z_]\w*)+")  # zero_lab.course.bench
BACKTICKED_PY = re.compile(r"`([\w/]+\.py)`")  # `stages/zero3.py`, `tests/test_plain.py`
GUIDE_LINK = re.compile(r"\(zero_lab/README\.md#([\w-]+)\)")


def package_entries(pkg: Path = PKG) -> set[str]:
    """Every module (`memory.py`) and package (`predict/`) under `pkg`, relative to it;
    `__init__.py` files stand for their package."""
    names = set()
    for path in pkg.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(pkg)
        if path.name != "__init__.py":
            names.add(rel.as_posix())
        if len(rel.parts) > 1:
            names.add(rel.parent.as_posix() + "/")
    return names


def missing_from(text: str, names) -> list[str]:
    """The names `text` does not give in backticks, in sorted order."""
    return sorted(n for n in names if f"`{n}`" not in text)


def top_level_names(module: Path) -> set[str]:
    """What a module defines or imports at its top level, read without importing it."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def stale_dotted(name: str, root: Path = ROOT) -> str | None:
    """Why `zero_lab.a.b[.attr]` names nothing in the tree under `root`, or None when it does:
    its longest prefix that is a module or package, then (if anything is left) a name that
    module defines at its top level."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else \
            base / "__init__.py"
        if module.is_file():
            break
    else:
        return f"{name}: no such module"
    rest = parts[i:]
    if rest and rest[0] not in top_level_names(module):
        return f"{name}: {module.relative_to(root)} defines no {rest[0]}"
    return None


def stale_paths(text: str, root: Path = ROOT) -> list[str]:
    """Every module path and dotted module in `text` that the tree under `root` lacks."""
    stale = [p for p in PATH.findall(text) if not (root / p).is_file()]
    stale += [p for p in BACKTICKED_PY.findall(text)
              if not (root / p).is_file() and not (root / "zero_lab" / p).is_file()]
    stale += [why for d in DOTTED.findall(text) if (why := stale_dotted(d, root))]
    return sorted(set(stale))


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def course_map_rows(text: str) -> list[str]:
    return [ln for ln in text.splitlines()
            if ln.startswith("|") and re.search(r"notebooks/\d\d_\w+\.ipynb", ln)]


# ---- the guide names every module and package ----------------------------------------------

def test_the_guide_names_every_module_and_package():
    entries = package_entries()
    assert "stages/" in entries and "stages/zero3.py" in entries  # the tree is read at all
    assert missing_from(GUIDE.read_text(), entries) == []


def test_a_module_the_guide_does_not_name_is_caught():
    text = "`predict/` and `predict/links.py`; `collectives/ring.py` only unquoted: ring.py"
    fake = ["predict/", "predict/links.py", "predict/made_up.py", "collectives/ring.py",
            "nowhere/"]
    assert missing_from(text, fake) == ["nowhere/", "predict/made_up.py"]


def test_package_entries_reads_modules_and_packages(tmp_path):
    for rel in ["__init__.py", "a/__init__.py", "a/b.py", "a/c/__init__.py", "d.py",
                "a/__pycache__/b.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert package_entries(tmp_path) == {"a/", "a/b.py", "a/c/", "d.py"}


# ---- the course README stays short -----------------------------------------------------------

def test_the_readme_is_short():
    assert len(README.read_bytes()) < MAX_README_BYTES


def test_every_course_map_row_is_short():
    rows = course_map_rows(README.read_text())
    assert len(rows) == len(list((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))
    assert [(r[:40], len(r)) for r in rows if len(r) > MAX_MAP_ROW] == []


# ---- no stale path after a move ----------------------------------------------------------------

def test_no_path_or_module_either_readme_names_is_stale():
    for doc in (README, GUIDE):
        assert stale_paths(doc.read_text()) == [], doc.relative_to(ROOT)


def test_a_stale_path_or_module_is_caught(tmp_path):
    for rel, source in [("zero_lab/__init__.py", ""), ("zero_lab/predict/__init__.py", ""),
                        ("zero_lab/memory.py", ""), ("zero_lab/stages/__init__.py", ""),
                        ("zero_lab/stages/zero3.py", ""), ("zero_lab/course/__init__.py", ""),
                        ("zero_lab/course/bench.py", ""),
                        ("zero_lab/course/runner.py", "PRINT_WIDTH = 110\n"),
                        ("zero_lab/launch/__init__.py", "def torchrun():\n    pass\n"),
                        ("tests/test_plain.py", "")]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    fresh = ("`zero_lab/memory.py`, `stages/zero3.py`, `tests/test_plain.py`, "
             "zero_lab.course.bench, zero_lab.course.runner.PRINT_WIDTH, "
             "zero_lab.launch.torchrun(), zero_lab.predict.")
    assert stale_paths(fresh, tmp_path) == []
    stale = ("`zero_lab/predict/memory.py`, `stages/agreement.py`, `bench.py`, zero_lab.bench, "
             "zero_lab.course.runner.NO_SUCH_NAME, zero_lab.launch_env.")
    assert stale_paths(stale, tmp_path) == [
        "bench.py",
        "stages/agreement.py",
        "zero_lab.bench: zero_lab/__init__.py defines no bench",
        "zero_lab.course.runner.NO_SUCH_NAME: zero_lab/course/runner.py defines no NO_SUCH_NAME",
        "zero_lab.launch_env: zero_lab/__init__.py defines no launch_env",
        "zero_lab/predict/memory.py",
    ]


def test_the_readmes_links_into_the_guide_land_on_a_heading():
    anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", GUIDE.read_text(), re.M)}
    links = GUIDE_LINK.findall(README.read_text())
    assert links and sorted(set(links) - anchors) == []


# ---- the package stays small at its top ------------------------------------------------------

def test_the_package_has_few_top_level_entries():
    entries = sorted(p.name for p in PKG.iterdir() if p.name != "__pycache__")
    assert len(entries) <= MAX_TOP_LEVEL, entries
