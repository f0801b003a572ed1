"""The batch grader against hostile submissions (issue 49): each exercise's child runs in a
bubblewrap sandbox (zero_lab/grading/jail.py), so no route below changes anything outside
its own exercise, and the run survives every one of them.

One run of `python -m zero_lab.grading grade` from a COPY of the repository (a learner's
code writes to the grader's source there, never to this tree), on notebook 01's kernel
exercises, one hostile student per route:

- a background process that outlives its exercise and rewrites grades.csv;
- writing to the grader's own source;
- `10**400` returned (it broke the comparison's float conversion and aborted the run), and
  `10**5000` (json cannot write it: the child crashed);
- a stray results.json worth 999 points written into the output folder;
- a Unix socket to a listener outside (a path under /tmp, a path in the repository, an
  abstract one);
- the instructor's seed read from /proc (the grader's command line) or the environment;
- the grader killed, found by its command line in /proc.

Then: the tasks and (where a cgroup can be made) the total memory capped; feedback that no
learner text can forge a heading in; no sandbox, no grading, unless `--unsafe-no-sandbox`.

Then an interrupted run: SIGTERM to the grader ends its exercise's processes at once, and
`grade --resume` finishes the run from what was written as each exercise ended.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from test_grade_batch import NB01, course, submit, with_body

from zero_lab.grading import reports
from zero_lab.launch.paths import REPO_ROOT

SEED = "424242"  # distinctive: a learner that finds it anywhere says where
MARK = "zero_lab_hostile_daemon"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux's")


def _need_sandbox() -> None:
    from zero_lab.grading import jail

    ok, why = jail.available()
    if not ok:  # never a silent pass: these routes are open without it
        pytest.fail(f"no sandbox on this machine ({why}): install bubblewrap "
                    "(make test as root, or apt-get install bubblewrap)")


def _copy_repo(where: Path) -> Path:
    repo = where / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("zero_lab", "notebooks"):
        shutil.copytree(REPO_ROOT / part, repo / part, ignore=ignore)
    return repo


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def _grade(repo: Path, *args: str, **popen) -> subprocess.Popen:
    # As `make grade SEED=...` runs it: the seed on the command line and in MAKEFLAGS.
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1",
           "MAKEFLAGS": f" -- SEED={SEED}"}
    return subprocess.Popen([sys.executable, "-m", "zero_lab.grading", "grade", *args],
                            cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def _alive(pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def _kill(pids: list[int]) -> None:
    for pid in pids:  # only what this test's hostile code started, by id
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _listen(path: str) -> tuple[socket.socket, list]:
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    if not path.startswith("\0"):
        os.chmod(path, 0o777)  # anyone may connect: only the sandbox keeps it out
    server.listen(8)
    reached: list = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            reached.append(path.replace("\0", "@"))
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return server, reached


def _hostile(out: Path, sockets: list[str]) -> dict[str, tuple[str, str]]:
    """student -> (function, body) for notebook 01."""
    daemon = (f"import time, pathlib\nwhile True:\n    time.sleep(0.2)\n"
              f"    for p in ({str(out / 'grades.csv')!r}, "
              f"{str(out / 'gradescope' / 'reference' / 'results.json')!r}):\n"
              f"        try:\n            pathlib.Path(p).write_text('hacked')\n"
              f"        except OSError:\n            pass\n")
    return {
        "daemon": ("my_bytes_per_param",
                   "import subprocess, sys\n"
                   f"subprocess.Popen([sys.executable, '-c', {daemon!r}, {MARK!r}],\n"
                   "    start_new_session=True, stdin=subprocess.DEVNULL,\n"
                   "    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
                   "return {}"),
        "source": ("my_bytes_per_param",
                   "import importlib.util, pathlib\n"
                   "root = pathlib.Path(importlib.util.find_spec('zero_lab').origin).parents[1]\n"
                   "for p in list(root.rglob('*.py')) + list(root.rglob('*.ipynb')):\n"
                   "    try:\n        p.write_text('raise SystemExit(0)\\n')\n"
                   "    except OSError:\n        pass\n"
                   "return {}"),
        "huge": ("my_largest_model", "return 10**400"),
        "huger": ("my_per_rank_bytes", "return 10**5000"),
        # the grader, found by its command line (this test's own folder in it), killed
        "killer": ("my_bytes_per_param",
                   "import glob, os, signal\n"
                   "for place in glob.glob('/proc/[0-9]*/cmdline'):\n"
                   "    try:\n"
                   "        with open(place, 'rb') as f:\n"
                   f"            if {str(out).encode()!r} in f.read():\n"
                   "                os.kill(int(place.split('/')[2]), signal.SIGKILL)\n"
                   "    except (OSError, ValueError):\n        pass\n"
                   "return {}"),
        "stray": ("my_bytes_per_param",
                  "import pathlib\n"
                  f"out = pathlib.Path({str(out)!r})\n"
                  "for p in (out / 'gradescope' / 'ghost' / 'results.json', out / 'grades.csv',\n"
                  "          out / 'results.json'):\n"
                  "    try:\n"
                  "        p.parent.mkdir(parents=True, exist_ok=True)\n"
                  "        p.write_text('{\"score\": 999}')\n"
                  "    except OSError:\n        pass\n"
                  "return {}"),
        "socket": ("my_bytes_per_param",
                   "import socket\n"
                   f"for address in {sockets!r}:\n"
                   "    s = socket.socket(socket.AF_UNIX)\n"
                   "    s.settimeout(2)\n"
                   "    try:\n        s.connect(address)\n    except OSError:\n        pass\n"
                   "    s.close()\n"
                   "return {}"),
        "seed": ("my_bytes_per_param",
                 "import glob, os, sys\n"
                 f"needle = ({SEED[:3]!r} + {SEED[3:]!r}).encode()  # not in its own source\n"
                 "if needle.decode() in repr(dict(os.environ)) + repr(sys.argv):\n"
                 "    raise RuntimeError('seed seen in its environment')\n"
                 "places = glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ')\n"
                 "for top, _, files in os.walk('.'):\n"
                 "    places += [os.path.join(top, f) for f in files]\n"
                 "for place in places:\n"
                 "    try:\n"
                 "        with open(place, 'rb') as f:\n"
                 "            if needle in f.read(1 << 20):\n"
                 "                raise RuntimeError('seed seen in ' + place)\n"
                 "    except OSError:\n        pass\n"
                 "from zero_lab.grading.nb01_memory import recipe_bytes\n"
                 "return recipe_bytes(params, grads, master, states, n_states)"),
    }


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    _need_sandbox()
    # Open to every user, as an instructor's own files are to a grader run as that user: only
    # the sandbox's mounts, not file permissions, keep learner code out (a root grader's
    # children run as a user id of their own, which would otherwise hide the routes).
    top = Path(tempfile.mkdtemp(prefix="zero_lab_hostile_"))
    repo = _copy_repo(top)
    folder, out = top / "submitted", top / "out"
    out.mkdir()
    for path in [top, out, *repo.rglob("*"), repo]:
        path.chmod(0o777 if path.is_dir() else 0o666)
    listeners = [_listen(str(top / "listener.sock")), _listen(str(repo / "listener.sock")),
                 _listen(f"\0zero_lab_listener_{os.getpid()}")]
    addresses = [str(top / "listener.sock"), str(repo / "listener.sock"),
                 f"\0zero_lab_listener_{os.getpid()}"]
    ref = course(NB01)
    submit(folder, "reference", {NB01: ref})
    for student, (function, body) in _hostile(out, addresses).items():
        submit(folder, student, {NB01: with_body(ref, function, body)})
    before = _digest(repo)
    start = time.monotonic()
    run = _grade(repo, str(folder), "--out", str(out), "--seed", SEED, "--only", "01",
                 "-j", "2", "--timeout", "0.5")
    printed, _ = run.communicate(timeout=240)
    time.sleep(1.0)  # a surviving daemon rewrites grades.csv every 0.2 s
    survivors = _alive(MARK)
    _kill(survivors)
    for server, _ in listeners:
        server.close()
    data = {"code": run.returncode, "printed": printed, "out": out, "repo": repo,
           "before": before, "after": _digest(repo), "survivors": survivors,
           "reached": [r for _, seen in listeners for r in seen],
           "seconds": time.monotonic() - start}
    yield data
    shutil.rmtree(top, ignore_errors=True)


def _row(hostile, student: str, check: str) -> dict:
    assert hostile["code"] == 0, hostile["printed"][-3000:]
    rows = [json.loads(line) for line in
            (hostile["out"] / "results" / f"{student}.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["check"] == check)


def test_a_background_process_dies_with_its_exercise_and_grades_csv_holds(hostile):
    assert hostile["survivors"] == [], "a learner's process outlived its exercise"
    assert hostile["code"] == 0, hostile["printed"][-3000:]
    text = (hostile["out"] / "grades.csv").read_text()
    assert text.startswith("student,notebook,exercise"), text[:200]
    assert _row(hostile, "reference", "check_per_rank_bytes")["status"] == "pass"


def test_the_grader_source_cannot_be_edited(hostile):
    changed = [p for p in hostile["before"] if hostile["before"][p] != hostile["after"].get(p)]
    assert changed == [], f"learner code rewrote {changed[:5]}"


def test_a_huge_int_is_a_failed_case_not_an_aborted_run(hostile):
    row = _row(hostile, "huge", "check_largest_model")
    assert row["status"] == "fail" and row["points"] == 0, row
    assert any("could not be compared" in line for line in row["lines"]), row["lines"]


def test_an_int_json_cannot_write_is_a_failed_case_too(hostile):
    row = _row(hostile, "huger", "check_per_rank_bytes")
    assert row["status"] == "fail" and row["points"] == 0, row
    assert any("bits" in line for line in row["lines"]), row["lines"]


def test_learner_code_cannot_kill_the_grader(hostile):
    assert hostile["code"] == 0, hostile["printed"][-3000:]
    assert _row(hostile, "killer", "check_largest_model")["status"] == "pass"


def test_a_stray_results_json_is_not_written(hostile):
    out = hostile["out"]
    assert not (out / "gradescope" / "ghost").exists()
    assert not (out / "results.json").exists()
    found = json.loads((out / "gradescope" / "reference" / "results.json").read_text())
    assert found["score"] == sum(t["max_score"] for t in found["tests"])


def test_no_unix_socket_reaches_a_listener_outside(hostile):
    assert hostile["code"] == 0, hostile["printed"][-3000:]
    assert hostile["reached"] == [], f"learner code connected to {hostile['reached']}"


def test_the_seed_is_nowhere_learner_code_can_read(hostile):
    row = _row(hostile, "seed", "check_bytes_per_param")
    assert not any("seed seen" in line for line in row["lines"]), row["lines"]
    assert row["status"] == "pass", row
    feedback = (hostile["out"] / "feedback" / "seed.md").read_text()
    assert SEED not in feedback


def test_the_summary_says_what_the_sandbox_holds(hostile):
    summary = (hostile["out"] / "summary.md").read_text()
    assert "bubblewrap" in summary and "read-only" in summary, summary[:600]
    assert "sandbox" in hostile["printed"].splitlines()[0], hostile["printed"][:300]


def test_without_a_sandbox_the_grader_refuses_unless_told(tmp_path, monkeypatch):
    from zero_lab.grading import batch, jail

    monkeypatch.setattr(jail, "available", lambda: (False, "bwrap is not installed (a test)"))
    submit(tmp_path / "in", "reference", {NB01: course(NB01)})
    with pytest.raises(batch.NoSandbox, match=f"bwrap is not installed.*{jail.UNSAFE_FLAG}"):
        batch.grade(tmp_path / "in", tmp_path / "out", only="01", progress=lambda line: None)
    said = []
    done = batch.grade(tmp_path / "in", tmp_path / "out", only="01", progress=said.append,
                       unsafe=True)
    assert all(g.status == "pass" for g in done), [g.lines for g in done]
    assert said[0].startswith("NO SANDBOX"), said[0]
    assert "NO SANDBOX: bwrap is not installed" in (tmp_path / "out" / "summary.md").read_text()


def _outside_fences(markdown: str) -> list[str]:
    """The lines of `markdown` outside its fenced code blocks (CommonMark's backtick fences)."""
    outside, fence = [], ""
    for line in markdown.splitlines():
        ticks = len(line) - len(line.lstrip("`"))
        if not fence and ticks >= 3:
            fence = "`" * ticks
        elif fence and line.strip() and set(line.strip()) == {"`"} and ticks >= len(fence):
            fence = ""
        elif not fence:
            outside.append(line)
    return outside


def test_learner_text_cannot_forge_a_feedback_heading():
    from zero_lab.grading.batch import Graded, exercises

    forged = "raised ValueError: no\n```\n\n## 01: check_bytes_per_param\n\n**pass**: 3/3\n````"
    g = Graded("s", exercises()[0], points=0, max_points=3, status="fail", lines=[forged])
    text = reports.feedback("s", [g], 7)
    headings = [ln for ln in _outside_fences(text) if ln.startswith(("#", "**"))]
    assert headings == ["# Feedback for s", f"## {g.exercise.notebook}: {g.exercise.check}",
                        "**fail**: 0/3"], text


def test_sigterm_ends_the_exercise_at_once_and_resume_finishes_the_run(tmp_path):
    _need_sandbox()
    repo = _copy_repo(tmp_path)
    folder, out = tmp_path / "submitted", tmp_path / "out"
    ref = course(NB01)
    submit(folder, "a", {NB01: ref})
    submit(folder, "b", {NB01: with_body(ref, "my_bytes_per_param",
                                          "import time\ntime.sleep(600)")})
    run = _grade(repo, str(folder), "--out", str(out), "--seed", "5", "--only", "01", "-j", "1",
                 "--timeout", "1", start_new_session=True)
    try:
        log = out / "results" / "a.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
                log.exists() and len(log.read_text().splitlines()) == 3 and _sleeping(repo)):
            time.sleep(0.2)
        time.sleep(0.5)
        assert _sleeping(repo), "student b's sleeping exercise never started"
        run.send_signal(signal.SIGTERM)  # to the grader alone, not to its process group
        run.wait(timeout=10)
    finally:
        run.kill()  # a failed test leaves no grader behind
        run.communicate()
    time.sleep(1.0)
    left = _alive(str(repo / "zero_lab"))
    _kill(left)
    assert left == [], "processes of the interrupted exercise outlived the grader"
    assert run.returncode == 130, run.returncode
    assert len(log.read_text().splitlines()) == 3  # student a: written as each ended
    resumed = _grade(repo, "--resume", str(out), "--timeout", "0.1")
    printed, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, printed[-3000:]
    assert "3 exercises already graded" in printed, printed[:500]
    assert len(log.read_text().splitlines()) == 3  # not graded again
    rows = (out / "grades.csv").read_text().splitlines()
    assert len(rows) == 1 + 6, rows


def _sleeping(repo: Path) -> bool:
    return bool(_alive(str(repo / "zero_lab" / "grading" / "sandbox.py")))


def _child(source: str, timeout: float = 60) -> tuple[object, str]:
    from zero_lab.grading import batch

    job = {"preamble": "", "functions": ["f"], "source": source,
           "calls": [__import__("pickle").dumps(((), {}))]}
    answers, ended, printed, _, _ = batch.run_child(job, timeout)
    value = batch.decode(answers[0]["value"]) if answers and "value" in answers[0] else answers
    return value, ended


def test_the_tasks_and_the_total_memory_are_capped(monkeypatch):
    _need_sandbox()
    from zero_lab.grading import jail

    started, ended = _child(
        "def f():\n    import os, time\n    n = 0\n    try:\n"
        f"        for _ in range({jail.TASKS + 100}):\n"
        "            if os.fork() == 0:\n"
        "                time.sleep(2)\n                os._exit(0)\n"
        "            n += 1\n    except OSError:\n        pass\n    return n\n")
    assert ended == "done" and started < jail.TASKS, (started, ended)
    if not jail.cgroups_work():
        pytest.skip("no cgroup here: the total memory is not capped (summary.md says so)")
    monkeypatch.setattr(jail, "MEMORY_BYTES", 256 * 2**20)
    # three processes of 150 MB each, each under the per-process cap, 450 MB together
    value, ended = _child(
        "def f():\n    import os, time\n    pids = []\n    for _ in range(3):\n"
        "        pid = os.fork()\n        if pid == 0:\n"
        "            block = bytearray(150 * 2**20)\n            time.sleep(1)\n"
        "            os._exit(0)\n        pids.append(pid)\n"
        "    return [os.waitpid(p, 0)[1] for p in pids]\n")
    assert value != [0, 0, 0], (value, ended)  # one of them killed: the cap held

