"""capacity.check_nproc: ranks against cores and memory; paths.new_run_dir: a folder of a
run's own (issue 34)."""

from __future__ import annotations

import multiprocessing
import warnings

import pytest

from zero_lab.launch import capacity, paths

MiB = capacity.MiB


def test_more_ranks_than_cores_warn_once_and_far_more_are_refused(monkeypatch):
    monkeypatch.setattr(capacity, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capacity.check_nproc(2, cores=2, memory=None)  # silent at the cores
    with pytest.warns(capacity.CapacityWarning, match="nproc=3 ranks on 2 cores take turns"):
        capacity.check_nproc(3, cores=2, memory=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capacity.check_nproc(3, cores=2, memory=None)  # said once a process is enough
    with pytest.warns(capacity.CapacityWarning):
        capacity.check_nproc(capacity.MAX_RANKS_PER_CORE * 2, cores=2, memory=None)  # the edge
    with pytest.raises(ValueError, match=r"nproc=9 ranks on 2 cores: refused.*nproc <= 8"):
        capacity.check_nproc(9, cores=2, memory=None)


def test_ranks_that_need_more_memory_than_available_are_refused_with_the_numbers():
    capacity.check_nproc(4, 250 * MiB, cores=4, memory=1000 * MiB)  # exactly fits
    with pytest.raises(ValueError, match=r"nproc=5 ranks need about 1,250 MiB \(250 MiB a "
                                         r"rank\).*1,000 MiB available.*nproc <= 4"):
        capacity.check_nproc(5, 250 * MiB, cores=8, memory=1000 * MiB)


@pytest.mark.parametrize("bad", ["2", 2.0, True, None])
def test_nproc_of_another_type_is_refused_by_name(bad):
    with pytest.raises(TypeError, match=r"nproc must be an int"):
        capacity.check_nproc(bad, cores=2, memory=None)


def test_the_memory_is_read_on_this_machine():
    available = capacity.available_memory()
    assert available is None or available > 0


def test_new_run_dirs_are_never_shared(tmp_path):
    made = {paths.new_run_dir("06_profiler", root=tmp_path) for _ in range(50)}
    assert len(made) == 50 and all(p.is_dir() and p.parent.name == "06_profiler" for p in made)


def _make(root):
    return str(paths.new_run_dir("07_choosing", root=root))


def test_new_run_dirs_from_several_processes_at_once_are_apart(tmp_path):
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        made = pool.map(_make, [tmp_path] * 16)
    assert len(set(made)) == 16


@pytest.mark.parametrize("kind", ["", "../x", ".hidden", "a/b"])
def test_a_run_kind_must_be_a_plain_name(tmp_path, kind):
    with pytest.raises(ValueError, match="plain folder name"):
        paths.new_run_dir(kind, root=tmp_path)


# ---- the memory limit that applies to this process (issue 47: shared teaching servers) -----
# Each test builds the files a Linux machine shows under a fake root: /proc/self/cgroup (the
# cgroups this process is in), /proc/meminfo, and the cgroup file systems under /sys/fs/cgroup.

def _files(root, files: dict) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


MEMINFO = {"proc/meminfo": f"MemTotal: {32 * 2**20} kB\nMemAvailable: {20 * 2**20} kB\n"}
V2 = "sys/fs/cgroup"
USER = f"{V2}/user.slice/user-1000.slice"


def test_a_cgroup_v2_limit_above_this_process_is_found_and_named(tmp_path):
    # JupyterHub's per-user limit sits on the user's slice, above the cgroup the process is
    # in (failed before: only /sys/fs/cgroup/memory.max was read, and 8 ranks were accepted).
    _files(tmp_path, {**MEMINFO,
                      "proc/self/cgroup": "0::/user.slice/user-1000.slice/session-3.scope\n",
                      f"{V2}/cgroup.controllers": "cpu memory pids\n",
                      f"{V2}/user.slice/memory.max": "max\n",
                      f"{V2}/user.slice/memory.current": f"{2000 * MiB}\n",
                      f"{USER}/memory.max": f"{1200 * MiB}\n",
                      f"{USER}/memory.current": f"{300 * MiB}\n",
                      f"{USER}/session-3.scope/memory.max": "max\n",
                      f"{USER}/session-3.scope/memory.current": f"{100 * MiB}\n"})
    available = capacity.available_memory(root=tmp_path)
    assert available == 900 * MiB
    assert available.source == ("the memory limit of cgroup /user.slice/user-1000.slice "
                                "(memory.max): 1,200 MiB, 300 MiB used")
    with pytest.raises(ValueError, match=r"nproc=8 ranks need about 1,600 MiB .* 900 MiB "
                                         r"available \(the memory limit of cgroup "
                                         r"/user\.slice/user-1000\.slice \(memory\.max\): "
                                         r"1,200 MiB, 300 MiB used\).*Use nproc <= 4\."):
        capacity.check_nproc(8, cores=8, memory=available)


def test_memory_high_counts_where_it_is_set(tmp_path):
    # memory.high: above it the kernel throttles the cgroup and reclaims hard; a run there
    # crawls, so it is the limit to plan under when it is the tighter one
    _files(tmp_path, {**MEMINFO, "proc/self/cgroup": "0::/user.slice/user-1000.slice\n",
                      f"{V2}/cgroup.controllers": "memory\n",
                      f"{USER}/memory.max": f"{4000 * MiB}\n",
                      f"{USER}/memory.high": f"{1000 * MiB}\n",
                      f"{USER}/memory.current": f"{200 * MiB}\n"})
    available = capacity.available_memory(root=tmp_path)
    assert available == 800 * MiB and "(memory.high): 1,000 MiB, 200 MiB used" in available.source


def test_a_cgroup_v1_memory_limit_is_read_from_its_hierarchy(tmp_path):
    # cgroup v1: the memory controller's own line and mount; the limit is on a parent, and
    # "no limit" is written as a huge number
    unlimited = "9223372036854771712\n"
    v1 = "sys/fs/cgroup/memory"
    _files(tmp_path, {**MEMINFO,
                      "proc/self/cgroup": "5:cpu,cpuacct:/\n4:memory:/jupyter/user1\n0::/\n",
                      f"{v1}/memory.limit_in_bytes": unlimited,
                      f"{v1}/memory.usage_in_bytes": f"{5000 * MiB}\n",
                      f"{v1}/jupyter/memory.limit_in_bytes": f"{1200 * MiB}\n",
                      f"{v1}/jupyter/memory.usage_in_bytes": f"{300 * MiB}\n",
                      f"{v1}/jupyter/user1/memory.limit_in_bytes": unlimited,
                      f"{v1}/jupyter/user1/memory.usage_in_bytes": f"{100 * MiB}\n"})
    available = capacity.available_memory(root=tmp_path)
    assert available == 900 * MiB
    assert available.source == ("the memory limit of cgroup /jupyter (memory.limit_in_bytes): "
                                "1,200 MiB, 300 MiB used")


def test_without_a_cgroup_limit_the_machines_available_memory_is_named(tmp_path):
    _files(tmp_path, {**MEMINFO, "proc/self/cgroup": "0::/\n",
                      f"{V2}/cgroup.controllers": "memory\n"})  # the root cgroup: no limit
    available = capacity.available_memory(root=tmp_path)
    assert available == 20 * 2**30 and available.source == "MemAvailable in /proc/meminfo"
    assert capacity.available_memory(root=tmp_path / "elsewhere") is None  # nothing to read


def test_an_address_space_limit_is_one_ranks_not_all_ranks(monkeypatch):
    # RLIMIT_AS (`ulimit -v`) bounds each process's virtual size, and a rank maps far more
    # than it touches (measured: VmSize 676 MiB, VmRSS 222 MiB after init_worker): too small a
    # limit stops every rank whatever nproc is, and a large one never adds up across ranks.
    import resource

    limit = {"value": 512 * MiB}
    monkeypatch.setattr(resource, "getrlimit",
                        lambda which: (limit["value"], resource.RLIM_INFINITY)
                        if which == resource.RLIMIT_AS else (resource.RLIM_INFINITY,) * 2)
    with pytest.raises(ValueError, match=r"address-space limit \(RLIMIT_AS, `ulimit -v`\) of "
                                         r"512 MiB a process.*every rank"):
        capacity.check_nproc(1, cores=2, memory=None)
    limit["value"] = 4 * 2**30
    capacity.check_nproc(8, cores=8, memory=None)  # 8 ranks x 1 GiB of address space: fine
    limit["value"] = resource.RLIM_INFINITY
    capacity.check_nproc(1, cores=8, memory=None)


def test_a_relative_runs_folder_is_resolved_where_the_command_started(tmp_path, monkeypatch):
    # A kernel runs in notebooks/: a relative ZERO_LAB_RUNS_DIR passed down as it is would
    # point there (failed before: the path came back relative)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ZERO_LAB_RUNS_DIR", "myruns")
    made = paths.new_run_dir("course")
    assert made.is_absolute() and made.parent == tmp_path / "myruns" / "course"
