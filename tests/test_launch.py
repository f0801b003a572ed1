"""The torchrun launcher: reports, live output, logs, failures, timeouts, bad input."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from zero_lab.launch import LaunchError, LaunchResult, LaunchTimeout, report, torchrun
from zero_lab.launch.paths import REPO_ROOT

PROBE = Path(__file__).parent / "workers" / "probe.py"


pytestmark = pytest.mark.usefixtures("temp_dir")  # tests/conftest.py


def _processes_with(marker: str) -> list[str]:
    """Command lines of live processes whose environment holds `marker` (leftover ranks)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes():
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


@dataclass
class ProbeRun:
    """A successful launch of the probe, and what was true right after it."""

    result: LaunchResult
    marker: str
    printed: str  # what torchrun() printed while it ran (rank 0's streamed lines)
    left_in_temp: list  # what the launch left in the (empty, private) temp dir
    left_running: list  # live processes that carry the launch's marker


def _probe_run(nproc: int, temp: Path) -> ProbeRun:
    marker = uuid.uuid4().hex
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setattr(tempfile, "tempdir", str(temp))  # as the temp_dir fixture does
        mp.setenv("TMPDIR", str(temp))
        result = torchrun(PROBE, nproc=nproc, args=["--lines", "3"],
                          env={"ZERO_LAB_TEST_MARKER": marker})
    return ProbeRun(result, marker, printed.getvalue(), list(temp.iterdir()),
                    _processes_with(marker))


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    """One successful probe launch per world size (made on first use), shared by the tests
    that read it."""
    return cache(lambda nproc: _probe_run(nproc, tmp_path_factory.mktemp(f"probe{nproc}")))


@pytest.mark.parametrize("nproc", [2, 3])
def test_every_rank_reports_and_rank0_streams(nproc, probe_run):
    run = probe_run(nproc)
    result, marker = run.result, run.marker
    assert [r["rank"] for r in result.ranks] == list(range(nproc))
    expected_sum = nproc * (nproc + 1) / 2
    for r, rep in enumerate(result.ranks):
        assert rep.pop("run_id").startswith("zero_lab-probe-")  # the launch's own rendezvous
        scratch = Path(rep.pop("scratch"))  # in the launch's own folder, shared by the ranks
        assert scratch.name == "scratch" and scratch.parent.name.startswith("zero_lab-probe-")
        assert rep == {
            "rank": r, "world_size": nproc, "backend": "gloo", "sum": expected_sum,
            "omp_threads": "1", "marker": marker, "env_backend": "gloo", "pet": [],
        }
    assert result.backend == "gloo" and result.nproc == nproc
    assert result.wall_time > 0
    assert run.printed.splitlines() == [f"[rank0] line {i} from rank 0" for i in range(3)]
    for r in range(nproc):  # every rank's own output comes back
        assert result.stdout[r].splitlines() == [f"line {i} from rank {r}" for i in range(3)]
    assert run.left_running == []


def test_a_successful_launch_leaves_no_folder_behind(probe_run):
    assert probe_run(2).left_in_temp == []  # its scratch folder (tests/workers/probe.py) too


RANK_SCRIPTS = (*(REPO_ROOT / "zero_lab" / "workers").glob("*.py"),
                *(REPO_ROOT / "tests" / "workers").glob("*.py"))


@pytest.mark.parametrize("script", RANK_SCRIPTS, ids=lambda p: p.name)
def test_rank_scripts_write_in_their_launch_folder_not_the_shared_temp(script):
    # A folder made with mkdtemp outlives the launch: the test workers had left ~170 of them
    # in /tmp (checkpoints of stage3_reads, accumulation and overlap cases) over a day of runs.
    assert "mkdtemp(" not in script.read_text(), (
        f"{script.name}: use zero_lab.launch.scratch_folder(name), removed with the launch")


def test_a_failed_launch_keeps_its_logs_and_names_them(temp_dir):
    with pytest.raises(LaunchError) as info:
        torchrun(PROBE, nproc=2, args=["--fail-rank", "1"], stream=False)
    run_dir = info.value.run_dir
    assert list(temp_dir.iterdir()) == [run_dir]
    for name in ("rank0.out", "rank0.err", "rank1.out", "rank1.err", "launcher.log"):
        assert str(run_dir / name) in str(info.value)
    assert "deliberate failure on rank 1" in (run_dir / "rank1.err").read_text()


def test_caller_env_overrides_omp_threads():
    result = torchrun(PROBE, nproc=2, env={"OMP_NUM_THREADS": "2"}, stream=False)
    assert {r["omp_threads"] for r in result.ranks} == {"2"}


def test_failing_rank_raises_with_its_traceback():
    marker = uuid.uuid4().hex
    with pytest.raises(LaunchError) as info:
        torchrun(PROBE, nproc=3, args=["--fail-rank", "2", "--late-fail-rank", "0"],
                 env={"ZERO_LAB_TEST_MARKER": marker}, stream=False)
    message = str(info.value)
    assert message.startswith(
        "rank 2 of 3 failed in probe.py: ValueError: deliberate failure on rank 2")
    assert 'probe.py", line' in message and "Traceback" in message
    assert str(info.value.run_dir / "rank2.err") in message
    assert info.value.rank == 2
    assert _processes_with(marker) == []
    # In a notebook: the rank's traceback, without the frames of torchrun() around it
    shown = "\n".join(info.value._render_traceback_())
    assert shown == f"\x1b[31mLaunchError\x1b[0m: {message}"
    assert "launch.py" not in shown


def test_non_serialisable_report_is_named():
    with pytest.raises(LaunchError, match=r"data\['loss'\] is not JSON-serialisable \(Tensor"):
        torchrun(PROBE, nproc=2, args=["--bad-report"], stream=False)


def test_hang_is_killed_soon_after_timeout():
    marker = uuid.uuid4().hex
    start = time.monotonic()
    with pytest.raises(LaunchTimeout, match="ran past timeout=12s") as info:
        torchrun(PROBE, nproc=2, args=["--hang-rank", "1"], timeout=12,
                 env={"ZERO_LAB_TEST_MARKER": marker}, stream=False)
    elapsed = time.monotonic() - start
    assert 12 <= elapsed < 12 + 6
    assert (info.value.run_dir / "rank1.out").exists()  # the logs it names are kept
    assert _processes_with(marker) == []


def test_two_launches_at_once_do_not_collide():
    results, errors = {}, []

    def launch(key):
        try:
            results[key] = torchrun(PROBE, nproc=2, stream=False,
                                    env={"ZERO_LAB_TEST_MARKER": key})
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=launch, args=(k,)) for k in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {key: {rep["marker"] for rep in res.ranks} for key, res in results.items()} == {
        "a": {"a"}, "b": {"b"}}  # each launch read its own ranks' reports
    assert all(rep["sum"] == 3.0 for res in results.values() for rep in res.ranks)


def test_works_from_a_plain_terminal():
    code = f"from zero_lab.launch import torchrun; torchrun({str(PROBE)!r}, nproc=2)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out == "[rank0] line 0 from rank 0\n"


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"nproc": 0}, ValueError, "nproc must be >= 1, got 0"),
        ({"nproc": "2"}, TypeError, "nproc must be an int (number of ranks), got '2'"),
        ({"nproc": 2, "args": "--x"}, TypeError, "args must be a list of strings"),
        ({"nproc": 2, "timeout": 0}, ValueError, "timeout must be a positive number"),
        ({"nproc": 2, "backend": "mpi"}, ValueError, "backend must be one of"),
    ],
)
def test_bad_arguments_fail_at_once(kwargs, error, text):
    with pytest.raises(error) as info:
        torchrun(PROBE, **kwargs)
    assert text in str(info.value)


def test_missing_script_is_named():
    with pytest.raises(FileNotFoundError, match="script 'no_such_worker.py' does not exist"):
        torchrun("no_such_worker.py", nproc=2)


def test_nccl_without_enough_gpus_is_refused():
    import torch

    if torch.cuda.device_count() >= 64:
        pytest.skip("machine has 64 GPUs")
    with pytest.raises(ValueError, match="backend='nccl' needs one CUDA device per rank"):
        torchrun(PROBE, nproc=64, backend="nccl")


def test_report_outside_a_launch_returns_the_merged_dict(monkeypatch):
    monkeypatch.delenv("ZERO_LAB_RUN_DIR", raising=False)
    assert report({"a": 1})["a"] == 1
    with pytest.raises(TypeError, match="report\\(data\\) takes a dict, got list"):
        report([1, 2])


def test_rank_script_magic_saves_the_cell_silently_and_runs_nothing(tmp_path, monkeypatch,
                                                                    capsys):
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.chdir(tmp_path)
    shell = InteractiveShell.instance()
    try:
        shell.run_line_magic("load_ext", "zero_lab.launch")
        cell = "%%rank_script workers/hello.py\nprint('hello from a rank')\n"
        assert shell.run_cell(cell).success
        missing_path = shell.run_cell("%%rank_script\nprint(1)\n")
    finally:
        InteractiveShell.clear_instance()  # leave no global shell behind for other tests
    assert (tmp_path / "workers" / "hello.py").read_text() == "print('hello from a rank')\n"
    assert "needs the path" in str(missing_path.error_in_exec)
    assert capsys.readouterr().out.count("hello") == 0  # nothing printed, nothing run
