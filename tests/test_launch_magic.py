"""The %%rank_script cell magic reads its line as IPython's %%writefile does (issue 22, point
15): quotes around a path with spaces, ~ for the home folder, -a to append, extra words
refused. Each line is given to both magics, each in a folder of its own, and the files they
leave must be the same."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CELL = "print('hello from a rank')\n"


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "zero_lab.launch")
    yield shell
    InteractiveShell.clear_instance()  # leave no global shell behind for other tests


def _run(shell, magic: str, line: str, folder: Path, monkeypatch, before: str | None = None):
    """Run `%%magic line` with the cell in `folder` (also the home folder); returns the error
    (None if it ran) and every file left there, {relative path: text}."""
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setenv("HOME", str(folder))
    if before is not None:
        (folder / "kept.py").write_text(before)
    result = shell.run_cell(f"%%{magic} {line}\n{CELL}")
    error = result.error_in_exec or result.error_before_exec
    files = {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*") if p.is_file()}
    return error, files


@pytest.mark.parametrize("line, written", [
    ('"my script.py"', "my script.py"),    # failed before: the quotes became part of the name
    ("'my script.py'", "my script.py"),    # (failed before)
    ("~/x.py", "x.py"),                    # failed before: a folder named ~ in the cwd
    ("  spaced.py  ", "spaced.py"),
    ("plain.py", "plain.py"),
    ("-a kept.py", "kept.py"),             # appends, as %%writefile -a (failed before)
])
def test_a_path_is_read_as_writefile_reads_it(shell, tmp_path, monkeypatch, capsys, line,
                                              written):
    before = "# already here\n" if line.startswith("-a") else None
    mine, mine_files = _run(shell, "rank_script", line, tmp_path / "mine", monkeypatch, before)
    theirs, their_files = _run(shell, "writefile", line, tmp_path / "theirs", monkeypatch, before)
    assert mine is None and theirs is None, (mine, theirs)
    assert mine_files == their_files
    assert mine_files[written].endswith(CELL)
    assert "rank_script" not in capsys.readouterr().out  # nothing printed by it


@pytest.mark.parametrize("line", ["ok.py extra", "a\\ b.py", '"unclosed.py', "-x ok.py"])
def test_a_line_writefile_refuses_is_refused_and_nothing_is_written(shell, tmp_path,
                                                                     monkeypatch, line):
    """(failed before: 'ok.py extra' wrote a file of that name, the others too)."""
    mine, mine_files = _run(shell, "rank_script", line, tmp_path / "mine", monkeypatch)
    assert mine is not None and mine_files == {}
    theirs, their_files = _run(shell, "writefile", line, tmp_path / "theirs", monkeypatch)
    assert theirs is not None and their_files == {}
    if line == "ok.py extra":
        assert "unrecognized arguments: extra" in str(mine)


def test_folders_are_made_where_writefile_would_fail(shell, tmp_path, monkeypatch):
    """The one difference, kept on purpose: %%rank_script makes the script's folders."""
    mine, files = _run(shell, "rank_script", '"~/my workers/a b.py"', tmp_path / "mine",
                       monkeypatch)
    assert mine is None and files == {os.path.join("my workers", "a b.py"): CELL}


def test_a_script_being_read_is_replaced_whole_not_rewritten_in_place(shell, tmp_path,
                                                                       monkeypatch):
    """Another kernel's ranks may be reading the script while this cell saves it (the browser
    test and nbval can run a notebook at once): they read the old text or the new, never a
    truncated file (failed before: the file was truncated in place, the reader saw "")."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "workers" / "w.py"
    script.parent.mkdir()
    script.write_text("old = 1\n")
    with script.open() as reading:  # opened before the save, read after it
        assert shell.run_cell(f"%%rank_script workers/w.py\n{CELL}").success
        assert reading.read() == "old = 1\n"
    assert script.read_text() == CELL
    assert sorted(p.name for p in script.parent.iterdir()) == ["w.py"]  # no temp file left


def test_a_save_that_fails_part_way_leaves_the_old_script(shell, tmp_path, monkeypatch):
    """A cell that cannot be encoded (a lone surrogate) fails the save: the old script stays
    whole and nothing else is left beside it (failed before: an empty script was left)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w.py").write_text("old = 1\n")
    result = shell.run_cell("%%rank_script w.py\nprint('\ud800')\n")
    assert isinstance(result.error_in_exec, UnicodeEncodeError)
    assert (tmp_path / "w.py").read_text() == "old = 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["w.py"]
