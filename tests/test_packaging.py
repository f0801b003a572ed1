"""The course's set-up contract: one place for pins, a mirrored conda file, hygienic notebooks."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")


def _pyproject_pins() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + project["optional-dependencies"]["dev"]


def test_every_requirement_is_pinned_exactly():
    for requirement in _pyproject_pins():
        assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.]*", requirement), requirement


def test_torch_is_the_course_pin():
    assert "torch==2.13.0" in _pyproject_pins()


def test_environment_yml_mirrors_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "python=3.11" in env["dependencies"]
    assert sorted(pip_section) == sorted(_pyproject_pins())


def test_make_help_lists_every_target():
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    listed = re.findall(r"make (\w+)", out)
    for target in ["setup", "lab", "run", "figures", "test", "soak", "student", "bench", "clean"]:
        assert target in listed


def test_readme_opens_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```(?:bash|sh)?\n(.*?)```", text, re.S).group(1)
    assert [ln.split("#")[0].strip() for ln in first_block.strip().splitlines()] == [
        "make run", "make test"]


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()


NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stripped_and_parameterised(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c["outputs"] and c["execution_count"] is None for c in code), (
        f"{path.name} has outputs: strip them before committing")
    assert nb["cells"][0]["cell_type"] == "markdown"
    tagged = [c for c in code if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
    source = "".join(tagged[0]["source"])
    for name in ("nproc", "backend", "device"):
        assert re.search(rf"^{name}\s*=", source, re.M), f"{path.name}: no {name} parameter"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_on_the_readme_course_map(path):
    assert f"notebooks/{path.name}" in (ROOT / "README.md").read_text()
