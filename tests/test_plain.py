"""zero_lab.plain, the reading layer: each plain stage pinned to one process and to shard().

The numbers come from tests/workers/plain_cases.py, a part of the launch per world size that
the case workers share (tests/common.py): per stage 0-3 at N = 2 and 3, the plain stage, the
real stage on torch's collectives and one process on the global batch, trained 3 steps from
the same weights (ranks start apart: both stages broadcast rank 0's), and one steady step's
ledger of each. The files themselves are read here: short, mostly code, standing alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from common import case_reports

from zero_lab.launch.paths import REPO_ROOT

PLAIN = REPO_ROOT / "zero_lab" / "plain"
STAGE_FILES = [PLAIN / f"stage{k}.py" for k in range(4)]
FP32_ATOL = 1e-6  # weights of size ~0.1-1 after 3 steps; measured worst 3e-8 (N = 3)
BUCKETS = 5  # of plain_cases.Net at its 200-byte buckets (stages 0-2)
UNITS = 4  # of plain_cases.Net at stage 3: three Linear layers and the root's scale


@pytest.fixture(scope="module", params=(2, 3), ids=lambda n: f"N={n}")
def ranks(request) -> tuple[int, tuple[dict, ...]]:
    return request.param, case_reports("plain", request.param)


def cases(reports: tuple[dict, ...]):
    for rank, report in enumerate(reports):
        assert [c["stage"] for c in report["cases"]] == [0, 1, 2, 3]
        for c in report["cases"]:
            yield rank, c


def test_each_plain_stage_trains_as_one_process_and_as_shard(ranks):
    n, reports = ranks
    assert len(reports) == n
    for rank, c in cases(reports):
        where = f"stage {c['stage']}, rank {rank}"
        assert c["moved"] > 1e-2, f"{where}: the reference barely trained"
        assert c["plain_vs_one_process"] <= FP32_ATOL, (where, c["plain_vs_one_process"])
        assert c["plain_vs_shard"] <= FP32_ATOL, (where, c["plain_vs_shard"])
        assert c["shard_vs_one_process"] <= FP32_ATOL, (where, c["shard_vs_one_process"])


def test_each_plain_stage_sends_the_collectives_and_bytes_of_the_real_one(ranks):
    _, reports = ranks
    for rank, c in cases(reports):
        plain, real = c["plain"], c["shard"]
        where = f"stage {c['stage']}, rank {rank}"
        assert plain["signature"] == real["signature"], (where, plain["ops"], real["ops"])
        assert plain["total_bytes"] == real["total_bytes"] > 0, where
        assert plain["volume"] == real["volume"], where
        assert plain["control"] == real["control"] == 0, where  # no lockstep message


def test_each_plain_stage_sends_what_its_table_says(ranks):
    """The shape of a step: stage 0 an all-reduce a bucket, in backward; stages 1-2 a
    reduce-scatter and an all-gather a bucket (stage 2's reduce-scatters in backward);
    stage 3 two all-gathers and a reduce-scatter a unit, the reduce-scatters in backward."""
    _, reports = ranks
    for rank, c in cases(reports):
        ops = c["plain"]["ops"]
        count = {op: sum(o == op for o, _, _ in ops) for op in ("all_reduce", "reduce_scatter",
                                                                 "all_gather")}
        expected = {0: {"all_reduce": BUCKETS, "reduce_scatter": 0, "all_gather": 0},
                    1: {"all_reduce": 0, "reduce_scatter": BUCKETS, "all_gather": BUCKETS},
                    2: {"all_reduce": 0, "reduce_scatter": BUCKETS, "all_gather": BUCKETS},
                    3: {"all_reduce": 0, "reduce_scatter": UNITS, "all_gather": 2 * UNITS}}
        assert count == expected[c["stage"]], (c["stage"], rank, ops)
        in_backward = {op for op, _, backward in ops if backward}
        assert in_backward == {0: {"all_reduce"}, 1: set(), 2: {"reduce_scatter"},
                               3: {"reduce_scatter", "all_gather"}}[c["stage"]], (c["stage"], ops)


def line_counts(path: Path) -> tuple[int, int, int]:
    """(all lines, code lines, non-blank lines after the opening docstring). Code: not
    blank, not a comment, not inside a docstring (module, class or function)."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) and ast.get_docstring(
                node, clean=False) is not None:
            docstrings.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    code = [i for i, line in enumerate(lines, 1)
            if line.strip() and not line.strip().startswith("#") and i not in docstrings]
    after_table = [i for i, line in enumerate(lines, 1)
                   if line.strip() and i > tree.body[0].end_lineno]
    return len(lines), len(code), len(after_table)


@pytest.mark.parametrize("path", STAGE_FILES, ids=lambda p: p.name)
def test_each_plain_stage_is_one_short_file_mostly_code(path):
    """At most 150 lines; most lines code (not blank, comment or docstring); after the
    opening table, at least four fifths of the lines that are not blank are code."""
    total, code, after_table = line_counts(path)
    assert total <= 150, f"{path.name}: {total} lines"
    assert code / total > 0.5, f"{path.name}: {code} of {total} lines are code"
    assert code >= 0.8 * after_table, f"{path.name}: {code} of {after_table} lines are code"


def test_the_plain_package_stands_alone():
    """zero_lab.plain imports torch and itself only: it is read without the real stages."""
    for path in PLAIN.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] in ("__future__", "functools", "torch", "zero_lab"), (
                    path.name, name)
                assert not name.startswith("zero_lab.") or name.startswith("zero_lab.plain"), (
                    path.name, name)
