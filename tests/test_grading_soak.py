"""The grader's soak (zero_lab/grading/soak.py): the reference class graded run after run
beside busy processes, every exercise counted, and a run where a reference copy lost a point
named with its run, student and case. Notebook 01's kernel exercises keep it quick."""

from __future__ import annotations

from zero_lab.grading import batch, soak


def test_the_reference_class_passes_every_run_beside_a_busy_process(tmp_path):
    said = []
    result = soak.soak(tmp_path, runs=2, load=1, students=2, only="01", say=said.append)
    assert len(result) == 3 and all(f == [] for f in result.values()), result
    assert len(said) == 2 and "6 exercises graded" in said[0], said
    assert {p.name for p in (tmp_path / "submitted").iterdir()} == {"reference0", "reference1"}


def test_a_reference_that_loses_a_case_in_one_run_is_named(tmp_path, monkeypatch):
    grade, runs = batch.grade, []

    def one_bad_run(folder, out, seed=0, **kwargs):  # a judge that fails by chance, once
        done = grade(folder, out, seed=seed, **kwargs)
        runs.append(seed)
        if len(runs) == 2:
            g = next(g for g in done if g.student == "reference0")
            g.status, g.points, g.first_failing = "fail", g.max_points - 1, "case 4 (a test)"
        return done

    monkeypatch.setattr(batch, "grade", one_bad_run)
    result = soak.soak(tmp_path, runs=2, load=0, students=1, only="01", say=lambda line: None)
    failed = [(key, f) for key, fs in result.items() for f in fs]
    assert len(failed) == 1, result
    assert failed[0][1].startswith("run 1 (seed 1), reference0: fail") and "case 4" in failed[0][1]
