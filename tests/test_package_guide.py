"""The two READMEs, kept true (issue 36, part 4): the course README stays short, the package
guide (zero_lab/README.md) names every module and package, and no path or dotted module either
of them names is stale after a move. Nor does any docstring, comment or notebook name a module
or function that is gone, nor an import alias keep an old name alive (issue 51, part 2).
Plain text checks: no imports of zero_lab, no launches."""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "zero_lab"
README = ROOT / "README.md"
GUIDE = PKG / "README.md"
MAX_README_BYTES = 15_000
MAX_MAP_ROW = 300
MAX_TOP_LEVEL = 15  # 12 packages, __init__.py, the guide, memory.py (the public API)
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen")

PATH = re.compile(r"\bzero_lab/[\w/]*\w\.py\b")  # zero_lab/memory.py
DOTTED = re.compile(r"\bzero_lab(?:\.[A-Za-z_]\w*)+(?![\w*<])")  # zero_lab.course.bench
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


def test_the_guide_counts_the_top_level_entries():
    entries = [p for p in PKG.iterdir() if p.name != "__pycache__"]
    packages = [p for p in entries if (p / "__init__.py").is_file()]
    said = re.search(r"(\w+) top-level entries: .*? and (\w+) packages\.", GUIDE.read_text(), re.S)
    assert said, "the guide's Layout no longer counts the top-level entries"
    assert [NUMBERS.index(w.lower()) for w in said.groups()] == [len(entries), len(packages)]


# ---- no stale name in docstrings, comments or notebooks (issue 51, part 2) ------------------

# Modules zero_lab once had and has no more (read off `git log --name-only -- zero_lab`).
# Names with an underscore count wherever they stand as a word; a plain word ("measured",
# "worker") only as a module is named: dotted (`measured.held_bytes`), or backticked alone
# where the file has no variable of that name. Left out: names that live on as something else
# (`check_ring_reduce_scatter` and `finish_in_flight` are functions, `in_flight` an attribute;
# collectives/, course/, grading/, launch/, measure/ are packages).
REMOVED_MODULES = ("cost_model", "in_flight_work", "interconnect", "knob_formulas", "knob_table",
                   "launch_env", "launch_failures", "measured", "recompute_tradeoff",
                   "stage_exercises", "step_clock", "step_timeline", "worker")
BACKTICKED_REF = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w*<])")  # `links.fit_op_links`
FILE_SUFFIXES = {"py", "md", "png", "json", "txt", "csv", "ipynb", "log", "pt", "safetensors",
                 "yml", "toml", "gz", "html", "svg"}  # `bench.md` names a file, not an attribute
MAGIC = re.compile(r"^\s*(?:%|!(?!=))")  # a notebook cell's %%rank_script, !pip lines

# Conventional short aliases (anything else is imported under its own name): torch's dist, F,
# dcp, dsd, funcol, DDP; numpy's np, matplotlib's plt, xml's ET, hypothesis's st, ipywidgets' w;
# the course's own W (workloads), C (collectives), B (bench), iv (intervals), tp
# (tensor_parallel). A notebook's check module may go by its notebook (`nb08_knobs as nb08`) or
# its role in the notebook (`checks`, `acc_checks`, `rc_checks`, `runs`).
SHORT_ALIASES = {
    ("torch.distributed", "dist"), ("torch.nn.functional", "F"), ("numpy", "np"),
    ("torch.distributed.checkpoint", "dcp"), ("torch.distributed.checkpoint.state_dict", "dsd"),
    ("torch.distributed._functional_collectives", "funcol"), ("DistributedDataParallel", "DDP"),
    ("matplotlib.pyplot", "plt"), ("xml.etree.ElementTree", "ET"), ("strategies", "st"),
    ("ipywidgets", "w"), ("workloads", "W"), ("collectives", "C"), ("bench", "B"),
    ("intervals", "iv"), ("tensor_parallel", "tp"),
}
ROLE_ALIAS = re.compile(r"(nb\d\d)_\w+ as (?:\1|checks|acc_checks|rc_checks|runs)")

# Stale names and aliases allowed for now, as (file, name) pairs: none (issue 51 emptied it).
STAGES_PENDING: set[tuple[str, str]] = set()


def removed_module_names(names=REMOVED_MODULES) -> re.Pattern:
    alts = [rf"(?<![\w./]){n}\b" if "_" in n else rf"(?<![\w./]){n}(?=\.[A-Za-z_])|`{n}`"
            for n in names]
    return re.compile("|".join(alts))


def prose(source: str) -> str:
    """A Python source's docstrings and comments (no code), one after another."""
    parts = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            parts.append(ast.get_docstring(node, clean=False) or "")
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return "\n".join(parts + [t.string for t in tokens if t.type == tokenize.COMMENT])


def code_cells(path: Path) -> list[tuple[str, str]]:
    """A notebook's cells as (type, source), a code cell's magic lines blanked."""
    cells = json.loads(path.read_text())["cells"]
    return [(c["cell_type"], "".join(c["source"]) if c["cell_type"] != "code" else
             "\n".join("" if MAGIC.match(ln) else ln for ln in "".join(c["source"]).splitlines()))
            for c in cells]


def names_anywhere(source: str) -> set[str]:
    """Every name a source defines, assigns or takes as an argument, at any depth."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


class Tree:
    """What a stale name is checked against, read once: zero_lab/'s and tests/' Python files
    and each module's short name (`links`) -> its dotted names (`zero_lab.predict.links`)."""

    def __init__(self, root: Path = ROOT):
        self.root = root
        self.files = sorted(p for d in ("zero_lab", "tests") for p in (root / d).rglob("*.py")
                            if "__pycache__" not in p.parts)
        self.bare = {p.name for p in self.files}
        self.modules = {}
        for path in (root / "zero_lab").rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            if "__pycache__" not in parts:
                self.modules.setdefault(parts[-1], []).append(".".join(parts))

    def stale_ref(self, ref: str) -> str | None:
        """Why `links.fit_op_links` (a module's short name, then names) names nothing, or
        None (None too where the first word is no zero_lab module: `torch.cat`, `self.x`)."""
        short, *rest = ref.split(".")
        if short not in self.modules or rest[-1] in FILE_SUFFIXES:
            return None
        whys = []
        for dotted in self.modules[short]:
            why = stale_dotted(".".join([dotted, *rest]), self.root)
            if why is None:
                return None
            module, _, name = why.split(": ", 1)[1].partition(" defines no ")
            if name and name in names_anywhere((self.root / module).read_text()):
                return None  # an attribute of an object the module makes: `ledger.control`
            whys.append(why.split(": ", 1)[1])
        return f"{ref}: " + "; ".join(whys)

    def stale_names(self, text: str, here: Path, variables=frozenset()) -> list[str]:
        """Every module, file or function `text` (from the folder `here`, whose code has
        `variables`) names that the tree lacks. A bare `name.py` must exist in zero_lab/ or
        tests/; a path `a/b.py` under the root, zero_lab/ or `here`, whichever has an `a/`."""
        root = self.root
        stale = {p for p in PATH.findall(text) if not (root / p).is_file()}
        for p in BACKTICKED_PY.findall(text):
            bases = [b for b in (root, root / "zero_lab", here) if (b / p.split("/")[0]).is_dir()]
            gone = p not in self.bare if "/" not in p else \
                bases and not any((b / p).is_file() for b in bases)
            if gone:
                stale.add(p)
        stale |= {why for d in DOTTED.findall(text) if (why := stale_dotted(d, root))}
        stale |= {m.group(0).strip("`") for m in removed_module_names().finditer(text)
                  if m.group(0).strip("`") not in variables or not m.group(0).startswith("`")}
        stale |= {why for r in BACKTICKED_REF.findall(text) if (why := self.stale_ref(r))}
        return sorted(stale)

    def stale_in_the_course(self) -> set[tuple[str, str]]:
        """(file, stale name) for every docstring and comment in zero_lab/ and tests/ (this
        file aside: it names stale things on purpose) and every notebook."""
        found = set()
        for path in self.files + sorted((self.root / "notebooks").glob("*.ipynb")):
            if path.name == Path(__file__).name:
                continue
            if path.suffix == ".py":
                sources, texts = [path.read_text()], [prose(path.read_text())]
            else:
                cells = code_cells(path)
                sources = [s for kind, s in cells if kind == "code"]
                texts = [s if kind == "markdown" else prose(s) for kind, s in cells
                         if kind != "raw"]
            variables = set().union(*map(names_anywhere, sources))
            found |= {(path.relative_to(self.root).as_posix(), name.split(":")[0])
                      for name in self.stale_names("\n".join(texts), path.parent, variables)}
        return found

    def aliases(self) -> set[tuple[str, str]]:
        """(file, "x as y") for every import under another name, but conventional short ones,
        in zero_lab/, tests/ and the notebooks' code cells."""
        found = set()
        for path in self.files + sorted((self.root / "notebooks").glob("*.ipynb")):
            sources = [path.read_text()] if path.suffix == ".py" else \
                [s for kind, s in code_cells(path) if kind == "code"]
            imports = [n for s in sources for n in ast.walk(ast.parse(s))
                       if isinstance(n, (ast.Import, ast.ImportFrom))]
            for a in (a for node in imports for a in node.names if a.asname):
                said = f"{a.name} as {a.asname}"
                if a.asname != a.name.split(".")[-1] and (a.name, a.asname) not in SHORT_ALIASES \
                        and not ROLE_ALIAS.fullmatch(said):
                    found.add((path.relative_to(self.root).as_posix(), said))
        return found


def pending(aliases: bool) -> set[tuple[str, str]]:
    return {(f, name) for f, name in STAGES_PENDING if (" as " in name) == aliases}


def test_no_docstring_comment_or_notebook_names_a_stale_module_or_function():
    found = Tree().stale_in_the_course()
    assert sorted(found - pending(aliases=False)) == []
    assert sorted(pending(aliases=False) - found) == []  # fixed meanwhile: take it off the list


def test_no_import_alias_keeps_an_old_name_alive():
    found = Tree().aliases()
    assert sorted(found - pending(aliases=True)) == []
    assert sorted(pending(aliases=True) - found) == []  # fixed meanwhile: take it off the list


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, source in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(source)


def test_a_stale_name_in_a_docstring_comment_or_notebook_is_caught(tmp_path):
    fresh = ('"""`links.fit_op_links`, `ledger.control`, `torch.cat`, `workers/cases.py`, a\n'
             'worker. `cases.py`, zero_lab.grading.check_<name>, measured in ms, `measured`."""\n'
             "measured = {}  # a variable: `measured` names it\nx = worker.start()\n"
             "# `predict/links.py`, zero_lab.predict.links.fit_op_links\n")
    stale = ('"""The alpha-beta model of `interconnect`, knob_formulas\' messages."""\n\n\n'
             'def f():\n    """`measured.held_bytes` and worker._run_agent."""\n'
             "    return 1  # `links.fit_alpha`, `gone.py`, `predict/gone.py`, zero_lab.gone\n")
    cells = [{"cell_type": "markdown", "source": ["`knob_table.text` prints it\n"]},
             {"cell_type": "code", "source": ["%%rank_script x.py\n", "import os  # `worker`\n",
                                              "y = measured.items()\n"]}]
    _write(tmp_path, {"zero_lab/__init__.py": "", "zero_lab/predict/__init__.py": "",
                      "zero_lab/predict/links.py": "def fit_op_links():\n    pass\n",
                      "zero_lab/collectives/__init__.py": "", "zero_lab/grading/__init__.py": "",
                      "zero_lab/collectives/ledger.py":
                          "class L:\n    def __init__(self):\n        self.control = []\n",
                      "tests/workers/cases.py": "", "tests/test_fresh.py": fresh,
                      "tests/test_stale.py": stale,
                      "notebooks/01_x.ipynb": json.dumps({"cells": cells})})
    assert sorted(Tree(tmp_path).stale_in_the_course()) == [
        ("notebooks/01_x.ipynb", "knob_table"), ("notebooks/01_x.ipynb", "worker"),
        ("tests/test_stale.py", "gone.py"), ("tests/test_stale.py", "interconnect"),
        ("tests/test_stale.py", "knob_formulas"), ("tests/test_stale.py", "links.fit_alpha"),
        ("tests/test_stale.py", "measured"), ("tests/test_stale.py", "predict/gone.py"),
        ("tests/test_stale.py", "worker"), ("tests/test_stale.py", "zero_lab.gone"),
    ]


def test_an_alias_keeping_an_old_name_alive_is_caught(tmp_path):
    source = ("import numpy as np\nimport torch.distributed as dist\n"
              "from zero_lab.grading import nb08_knobs as nb08, nb07_scaling as checks\n"
              "from zero_lab.predict import links as interconnect\n"
              "from zero_lab.checkpoint import manifest as manifest_\n\n\n"
              "def f():\n    from zero_lab.predict.step_time import _integer as _checked_integer\n")
    cells = [{"cell_type": "code", "source": ["import bench as B\n", "import recompute as rt\n"]}]
    _write(tmp_path, {"tests/test_x.py": source, "notebooks/01_x.ipynb":
                      json.dumps({"cells": cells})})
    assert sorted(Tree(tmp_path).aliases()) == [
        ("notebooks/01_x.ipynb", "recompute as rt"),
        ("tests/test_x.py", "_integer as _checked_integer"),
        ("tests/test_x.py", "links as interconnect"),
        ("tests/test_x.py", "manifest as manifest_"),
    ]


# ---- the README's first screen says what `make` does ------------------------------------------

def first_screen_gaps(readme: str, makefile: str, numbers: list[str]) -> list[str]:
    """What the README's opening (before its first `##`) gets wrong about the Makefile: a
    target it does not name, or notebooks it puts in the wrong runner."""
    first = readme.split("\n## ")[0]
    phony = re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split()
    gaps = [t for t in phony if f"`{t}`" not in first and f"make {t}" not in first]
    listed = re.search(r"^BROWSER_NOTEBOOKS :=(.*)$", makefile, re.M).group(1)
    browser = sorted(re.findall(r"notebooks/(\d\d)_", listed))
    rest = [n for n in sorted(numbers) if n not in browser]
    said = f"{browser[0]}-{browser[-1]} in JupyterLab, {rest[0]}-{rest[-1]} under nbval"
    return gaps + ([] if said in first else [said])


def test_the_readmes_first_screen_names_every_target_and_the_notebooks_runners():
    numbers = [p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")]
    assert first_screen_gaps(README.read_text(), (ROOT / "Makefile").read_text(), numbers) == []


def test_a_first_screen_that_misstates_make_is_caught():
    makefile = (".PHONY: run test grade gpu-check\n"
                "BROWSER_NOTEBOOKS := notebooks/00_a.ipynb notebooks/01_b.ipynb\n")
    numbers = ["00", "01", "02", "03"]
    good = "make run\nmake test (00-01 in JupyterLab, 02-03 under nbval); `grade`, `gpu-check`"
    assert first_screen_gaps(good, makefile, numbers) == []
    stale = "make run\nmake test (nbval runs 02-08); `grade`\n## More\n`gpu-check`"
    assert first_screen_gaps(stale, makefile, numbers) == [
        "gpu-check", "00-01 in JupyterLab, 02-03 under nbval"]
