"""The course's set-up contract: one place for pins, a mirrored conda file, hygienic notebooks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")


def _pyproject_pins() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + [pin for extra in project["optional-dependencies"].values()
                                      for pin in extra]  # dev, and deepspeed: every extra


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
    listed = re.findall(r"make ([\w-]+)", out)
    phony = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
    assert sorted(listed) == sorted(phony)  # `make gpu-check` went unlisted (a hyphen)


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


# A stand-in for .venv/bin/python under `make test`: it says which run it is (pytest on tests/,
# nbval, or the side tests), leaves a mark, waits up to 5 s for the other runs' marks, and
# exits with the status named for its run in $FAKE_STATUS ("pytest=1 nbval=0 side=0").
FAKE_PYTHON = """#!/bin/sh
case "$*" in *--nbval-lax*) me=nbval;; *"pytest tests "*) me=pytest;; *) me=side;; esac
touch "$FAKE_MARKS/$me"
for other in pytest nbval side; do
  [ $other = $me ] && continue
  i=0; while [ ! -e "$FAKE_MARKS/$other" ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
  [ -e "$FAKE_MARKS/$other" ] && seen=yes || seen=no
  echo "$me ran, saw $other running: $seen"
done
echo "$me args: $*"
for kv in $FAKE_STATUS; do [ "${kv%%=*}" = "$me" ] && exit "${kv#*=}"; done
"""
LANES = ("pytest", "nbval", "side")


def run_make_test(makefile: Path, tmp_path: Path, statuses: tuple[int, int, int]):
    """`make test` of `makefile` with stand-ins for ruff and the venv's python: (exit status,
    what it printed)."""
    venv, marks = tmp_path / "venv", tmp_path / "marks"
    shutil.rmtree(marks, ignore_errors=True)
    marks.mkdir()
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "ruff").write_text("#!/bin/sh\nexit 0\n")
    for tool in (venv / "bin").iterdir():
        tool.chmod(0o755)
    # A make of its own: under `make test`, MAKEFLAGS would hand it the outer make's command-line
    # variables (PY=... would run the real pytest on tests/ again, and again).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env |= {"FAKE_MARKS": str(marks),
            "FAKE_STATUS": " ".join(f"{lane}={s}" for lane, s in zip(LANES, statuses, strict=True))}
    make = subprocess.Popen(
        ["make", "-s", "-f", str(makefile), "-o", f"{venv}/.installed", "test", f"VENV={venv}",
         f"NBVAL_LOG={tmp_path / 'nbval.log'}", f"SIDE_LOG={tmp_path / 'side.log'}",
         "ENSURE_CHROMIUM=true",
         "ENSURE_BWRAP=true"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)  # a group of its own: on a timeout, all of it is stopped
    try:
        shown, _ = make.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(make.pid, signal.SIGKILL)
        make.wait()
    return make.returncode, shown


def make_test_contract(makefile: Path, tmp_path: Path) -> list[str]:
    """What `make test` of `makefile` gets wrong: pytest, nbval and the side tests must run at the
    same time, nbval's output come after pytest's and the side tests' last, the side tests (the
    browser test among them) run in their own process only, and the target fail when any fails
    (pytest's 5, nothing collected, is no failure). Stops at the first case it gets wrong."""
    for statuses, passes in [((0, 0, 0), True), ((1, 0, 0), False), ((0, 1, 0), False),
                             ((0, 0, 1), False), ((5, 5, 5), True), ((5, 2, 5), False),
                             ((2, 5, 5), False), ((5, 5, 2), False)]:
        status, shown = run_make_test(makefile, tmp_path, statuses)
        case = ", ".join(f"{lane} {s}" for lane, s in zip(LANES, statuses, strict=True))
        if (status == 0) != passes:
            return [f"{case}: make exit {status}", shown]
        if any(f"{me} ran, saw {other} running: yes" not in shown
               for me in LANES for other in LANES if other != me):
            return [f"{case}: not at the same time", shown]
        if not 0 <= shown.find("pytest ran") < shown.find("nbval ran") < \
                shown.find("side ran"):
            return [f"{case}: the logs not in the order pytest, nbval, side", shown]
        # A side test runs once, in the side process (the lanes balance: Makefile).
        args = {me: set(line.split(" args: ", 1)[1].split()) for line in shown.splitlines()
                for me in LANES if line.startswith(f"{me} args: ")}
        if any(test not in args.get("side", ()) or f"--ignore={test}" not in args.get("pytest", ())
               or test in args.get("nbval", ())
               for test in ("tests/test_browser.py", "tests/test_grading_hangs.py",
                            "tests/test_grade_batch_ranks.py")):
            return [f"{case}: the side tests are not run in a process of their own, once", shown]
    return []


def test_make_test_runs_pytest_nbval_and_the_side_tests_at_once_and_fails_if_any_does(tmp_path):
    assert make_test_contract(ROOT / "Makefile", tmp_path) == []


@pytest.mark.parametrize("mutant", [
    ("& nbval=$$!;", "; nbval=$$!;"),                              # nbval first, then pytest
    ("[ $$tests -eq 0 ] && [ $$notebooks -eq 0 ]", "[ $$tests -eq 0 ]"),  # nbval's failure lost
    ("wait $$nbval; notebooks=$$?;", "notebooks=0;"),               # nbval not waited for
    ("$(PY) -m pytest tests $(NOT_PYTESTS_LANE) --durations",
     "$(PY) -m pytest tests --durations"),                         # the side tests twice
    ("& side=$$!;", "; side=$$!;"),                                 # the side tests first
    ("wait $$side; sided=$$?;", "sided=0;"),                        # the side tests unwaited
    ("&& [ $$sided -eq 0 ]", ""),                                   # their failure lost
    ('--durations=12 "$$@" >$(NBVAL_LOG)',
     '--durations=12 "$$@" $(BROWSER_TESTS) >$(NBVAL_LOG)'),        # the browser test twice
])
def test_a_make_test_that_breaks_the_contract_is_caught(tmp_path, mutant):
    text = (ROOT / "Makefile").read_text()
    assert mutant[0] in text
    broken = tmp_path / "Makefile"
    broken.write_text(text.replace(mutant[0], mutant[1]))
    assert make_test_contract(broken, tmp_path) != []
