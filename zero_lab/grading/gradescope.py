"""Gradescope's autograder zip for the course's notebooks, and what runs inside it.

    build(OUT.zip, ["01"]) -> OUT.zip           the zip to upload as the autograder
    python -m zero_lab.grading.gradescope run    what its run_autograder starts, per submission

The zip, as Gradescope unpacks it into /autograder/source:

    setup.sh          run once, as root, when Gradescope builds the image: Python, bubblewrap,
                      a venv, torch's CPU build at the course's pin (from PyPI, torch==X is the
                      CUDA build on Linux: gigabytes, and Gradescope has no GPU), then the course
                      with `pip install -e course/` at the pins of its pyproject.toml
    run_autograder    per submission: grades the notebook(s) in /autograder/submission with the
                      course's grader (batch.grade) and writes /autograder/results/results.json
    course/           the course as it was built: zero_lab/, notebooks/, pyproject.toml
    gradescope.json   the notebooks graded, the time-limit scale, whether a sandbox is required
    gradescope_secret the instructor's secret: a student's seed is hashed from it and the
                      submission's user id(s), so each student draws other hidden cases

`AUTOGRADER_ROOT` (default /autograder) and `AUTOGRADER_PYTHON` (default the venv setup.sh
made) move it all, so a test lays out a folder as Gradescope does and runs the real script.

results.json: a test per exercise, visible, with its score and how many hidden cases passed;
each failing exercise's cases (their inputs, expected values, what came back) in a second test,
visible only "after_published", so a student cannot collect the expected values by resubmitting.

What Gradescope isolates, and what it does not: each submission runs in a fresh container made
from the image, so no submission reaches another's results or a later run's grader; inside one
run, the student's code runs in the same container as run_autograder, as the same user unless
the grader's bubblewrap sandbox starts (Docker's default seccomp profile often forbids the
namespaces it needs; results.json says which held). So run_autograder removes the secret from
disk before any student code runs, the seed never goes where student code runs (batch.py), and
results.json is written last; without the sandbox a student's process that escapes its
exercise's session could still rewrite results.json before Gradescope reads it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from zero_lab.launch.paths import REPO_ROOT

SECRET, CONFIG = "gradescope_secret", "gradescope.json"
EXECUTABLE = 0o755 << 16  # a zip member's Unix mode, in external_attr's high half
SKIP = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache"}

SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, as root, in /autograder/source, when it builds the image.
set -euo pipefail
SRC="$(cd "$(dirname "$0")" && pwd)"
ROOT="${{AUTOGRADER_ROOT:-/autograder}}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# bubblewrap: the grader's sandbox (it says in results.json whether the container allowed it)
apt-get install -y -qq python3 python3-venv python3-pip bubblewrap
python3 -m venv "$ROOT/venv"
"$ROOT/venv/bin/pip" install --upgrade pip
# torch=={torch} from PyPI is the CUDA build on Linux; Gradescope has no GPU: the CPU build of
# the same version first, from PyTorch's CPU index, and pip then finds the pin met.
"$ROOT/venv/bin/pip" install --index-url https://download.pytorch.org/whl/cpu "torch=={torch}"
# The course at the pins of its pyproject.toml ({pins}).
"$ROOT/venv/bin/pip" install -e "$SRC/course"
"""

RUN = """#!/usr/bin/env bash
# Gradescope runs this per submission, in a fresh container of the image setup.sh built.
ROOT="${AUTOGRADER_ROOT:-/autograder}"
PYTHON="${AUTOGRADER_PYTHON:-$ROOT/venv/bin/python}"
# From course/, `-m` imports this zip's copy of the course, whatever else is installed.
cd "$ROOT/source/course" && exec "$PYTHON" -m zero_lab.grading.gradescope run
"""


def pins(pyproject: Path) -> list[str]:
    """The `name==version` pins of pyproject.toml's [project] dependencies."""
    text = pyproject.read_text(encoding="utf-8")
    block = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.MULTILINE | re.DOTALL)
    found = re.findall(r'"([A-Za-z0-9_.-]+==[^"]+)"', block.group(1)) if block else []
    if not any(p.startswith("torch==") for p in found):
        raise ValueError(f"{pyproject}: no torch==X pin among [project] dependencies")
    return found


def _course_files(course_root: Path):
    """(path in the zip, file) of the course: the package, the notebooks, pyproject, README."""
    yield "course/pyproject.toml", course_root / "pyproject.toml"
    yield "course/README.md", course_root / "README.md"  # pyproject's `readme`: pip needs it
    for top in ("zero_lab", "notebooks"):
        for path in sorted((course_root / top).rglob("*")):
            rel = path.relative_to(course_root)
            if path.is_file() and not SKIP & set(rel.parts) and path.suffix != ".pyc":
                yield f"course/{rel.as_posix()}", path


def build(out_zip: Path, notebooks: Sequence[str], secret: str | None = None,
          course_root: Path = REPO_ROOT, timeout_scale: float = 1.0, jobs: int = 2,
          require_sandbox: bool = False) -> Path:
    """Write Gradescope's autograder zip grading `notebooks` (names or their NN prefixes)."""
    from zero_lab.grading.batch import exercises
    from zero_lab.grading.collect import course_notebooks

    names = course_notebooks(course_root / "notebooks")
    graded = {e.notebook for e in exercises()}
    chosen = []
    for want in notebooks:
        hits = [n for n in names if n.startswith(want)]  # "01", "01_memory", the whole name
        if len(hits) != 1 or hits[0] not in graded:
            raise ValueError(f"gradescope: {want!r} names {len(hits)} course notebooks "
                             f"({', '.join(hits) or 'none'}); the graded ones: "
                             f"{', '.join(sorted(graded))}")
        chosen.append(hits[0])
    if not chosen:
        raise ValueError("gradescope: no notebooks to grade (give one or more, e.g. 01)")
    if jobs < 1 or timeout_scale <= 0:
        raise ValueError(f"gradescope: jobs {jobs} and timeout scale {timeout_scale} must be > 0")
    found = pins(course_root / "pyproject.toml")
    torch = next(p for p in found if p.startswith("torch==")).split("==", 1)[1]
    config = {"notebooks": chosen, "timeout_scale": timeout_scale, "jobs": jobs,
              "require_sandbox": require_sandbox}
    out_zip = Path(out_zip)
    out_zip.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out_zip, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in (("setup.sh", SETUP.format(torch=torch, pins=", ".join(found))),
                           ("run_autograder", RUN)):
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
            info.external_attr = EXECUTABLE
            z.writestr(info, text)
        z.writestr(CONFIG, json.dumps(config, indent=1))
        z.writestr(SECRET, secret or secrets.token_hex(32))
        for name, path in _course_files(course_root):
            z.write(path, name)
    return out_zip


def seed_for(secret: str, user_ids: Sequence[str]) -> int:
    """A student's (or a group's) seed: the secret and their user ids hashed. Without the
    secret, knowing one's own ids (or one's own seed) gives no other student's cases."""
    key = ",".join(sorted(str(u) for u in user_ids))
    return int.from_bytes(hashlib.sha256(f"zero_lab gradescope:{secret}:{key}".encode())
                          .digest()[:6], "big")


def _user_ids(metadata: Path) -> list[str]:
    data = json.loads(metadata.read_text(encoding="utf-8"))
    ids = [str(u["id"]) for u in data.get("users", []) if u.get("id") is not None]
    if not ids:
        raise ValueError(f"{metadata}: no users[].id (Gradescope writes the submitters there)")
    return ids


def _lay_out(submission: Path, folder: Path, names: list[str]) -> list[str]:
    """SUBMISSIONS/submission/<notebook>.ipynb from what the student uploaded (renamed files
    matched as collect.py matches them); returns what was taken, for the results' output."""
    from zero_lab.grading.collect import match_notebook

    newest: dict[str, Path] = {}
    for path in sorted(submission.rglob("*.ipynb")):
        if ".ipynb_checkpoints" in path.parts or path.is_symlink():
            continue
        name, _ = match_notebook(path.name, names)
        if name and (name not in newest or path.stat().st_mtime > newest[name].stat().st_mtime):
            newest[name] = path
    (folder / "submission").mkdir(parents=True)
    for name, path in newest.items():
        shutil.copyfile(path, folder / "submission" / name)
    return [f"{name} from {path.relative_to(submission)}" for name, path in newest.items()]


def run(root: Path | None = None) -> dict:
    """Grade the submission in ROOT/submission; write and return ROOT/results/results.json."""
    from zero_lab.grading import jail
    from zero_lab.grading.batch import grade

    root = Path(root or os.environ.get("AUTOGRADER_ROOT", "/autograder"))
    source = root / "source"
    config = json.loads((source / CONFIG).read_text(encoding="utf-8"))
    secret_file = source / SECRET
    if not secret_file.is_file():
        raise FileNotFoundError(f"{secret_file}: no secret (each run removes it from its own "
                                "container; Gradescope starts every run from the image)")
    secret = secret_file.read_text(encoding="utf-8").strip()
    secret_file.unlink()  # gone from disk before any of the student's code runs
    seed = seed_for(secret, _user_ids(root / "submission_metadata.json"))
    del secret
    sandboxed, why = jail.available()
    if config["require_sandbox"] and not sandboxed:
        raise RuntimeError(f"no sandbox in this container ({why}) and the zip requires one")
    work = Path(tempfile.mkdtemp(prefix="zero_lab_gradescope_"))
    taken = _lay_out(root / "submission", work / "submissions", config["notebooks"])
    graded = []
    for notebook in config["notebooks"]:
        graded += grade(work / "submissions", work / notebook, seed, config["jobs"],
                        config["timeout_scale"], only=notebook, unsafe=not sandboxed)
    note = ("each exercise ran in a bubblewrap sandbox" if sandboxed else
            f"no sandbox in this container ({why}); Gradescope's own container per "
            "submission is the isolation")
    results = results_json(graded, taken, note)
    (root / "results").mkdir(parents=True, exist_ok=True)
    (root / "results" / "results.json").write_text(json.dumps(results, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return results


def results_json(graded: list, taken: list[str], note: str) -> dict:
    """Gradescope's results.json: per exercise a visible test (score, cases passed) and, when
    it failed, its cases in a test shown only after the grades are published."""
    tests = []
    for g in graded:
        name = f"{g.exercise.notebook.removesuffix('.ipynb')}: {g.exercise.check}"
        tests.append({"name": name, "score": g.points, "max_score": g.max_points,
                      "status": "passed" if g.status == "pass" else "failed",
                      "output": f"{g.status}: {g.points} of {g.max_points} hidden cases pass"
                                + ("; the cases are shown when the grades are published"
                                   if g.lines else ""),
                      "visibility": "visible"})
        if g.lines:  # the expected values: after publication only
            tests.append({"name": f"{name}: the hidden cases", "output": "\n".join(g.lines),
                          "visibility": "after_published"})
    return {"score": sum(g.points for g in graded),
            "output": f"graded: {', '.join(taken) or 'no course notebook in the submission'}"
                      f"; {note}",
            "visibility": "visible", "stdout_visibility": "hidden", "tests": tests}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero_lab.grading gradescope")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("build", help="write the autograder zip")
    make.add_argument("notebooks", nargs="+", help="the notebooks graded, e.g. 01 03_zero1")
    make.add_argument("--out", type=Path, default=Path("autograder.zip"))
    make.add_argument("--secret", default=None, help="default: a new random one, in the zip")
    make.add_argument("--timeout", type=float, default=1.0, help="scales every time limit")
    make.add_argument("-j", "--jobs", type=int, default=2)
    make.add_argument("--require-sandbox", action="store_true",
                      help="fail a run whose container cannot start bubblewrap")
    sub.add_parser("run", help="grade /autograder/submission (what run_autograder starts)")
    args = parser.parse_args(argv)
    if args.command == "run":
        try:
            results = run()
        except Exception as exc:  # noqa: BLE001 - Gradescope shows results.json, not a trace
            root = Path(os.environ.get("AUTOGRADER_ROOT", "/autograder"))
            (root / "results").mkdir(parents=True, exist_ok=True)
            (root / "results" / "results.json").write_text(json.dumps(
                {"score": 0, "output": f"the autograder failed: {type(exc).__name__}: {exc}",
                 "stdout_visibility": "hidden", "tests": []}))
            print(f"gradescope run: {exc}", file=sys.stderr)
            return 1
        print(f"score {results['score']}; {results['output']}")
        return 0
    try:
        out = build(args.out, args.notebooks, args.secret, timeout_scale=args.timeout,
                    jobs=args.jobs, require_sandbox=args.require_sandbox)
    except (ValueError, FileNotFoundError) as exc:
        print(f"gradescope: {exc}", file=sys.stderr)
        return 2
    print(f"{out}: upload it as the assignment's autograder (keep it: its secret makes the "
          "students' seeds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
