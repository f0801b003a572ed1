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
