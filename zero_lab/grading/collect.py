"""An LMS download, laid out the way the grader reads it (SUBMISSIONS/<student>/<notebook>.ipynb).

    collect(DOWNLOAD, OUT) -> Collected        DOWNLOAD: a folder or a .zip, as downloaded

What an LMS hands an instructor, and how each is read:

- per-student folders (`alice/`, Moodle's `Jane Doe_12345_assignsubmission_file_/`) or
  per-student zips (`alice.zip`): the student is the folder's or zip's name (Moodle's: the
  name and its participant id);
- flat files (Canvas's `<student>[_LATE]_<user id>_<file id>_<file name>`): the student is
  Canvas's login name and user id;
- one wrapper folder around all of it (`submissions/`) is looked through;
- a zip inside a student's zip or folder is opened (one level of nesting, no more).

A file is a course notebook when its name holds a notebook's two-digit prefix and stem from the
course's notebooks/ folder (`03_zero1`), wherever an LMS or a browser put it:
`03_zero1-1.ipynb`, `03_zero1 (1).ipynb`, `03_zero1_late.ipynb`. Of two candidates for one
notebook the newest is taken (RULE); every file taken or ignored is listed with the reason.

Nothing in the download is trusted: zips are read in memory (no member path is ever written,
so no `../` escapes), only course notebook names and cleaned student names are written, and
symbolic links are not followed. A notebook whose code cells differ from this course's (by
cell id and the text outside the exercises' bodies) is still collected and reported "from
another version of the course": its exercises may then be `missing` or `tampered`.
"""

from __future__ import annotations

import calendar
import dataclasses
import io
import json
import re
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from zero_lab.grading.student import BEGIN_MARK, student_notebook
from zero_lab.grading.submissions import code_cells, outside_bodies
from zero_lab.launch.paths import NOTEBOOKS

RULE = ("the newest file (modification time, as the zip or the folder gives it); on a tie, the "
        "higher LMS copy number (`-2`, ` (2)`), then a late one, then the name")
MAX_BYTES = 50 * 2**20  # a notebook with its outputs is well under this; a bomb is not read
ZIP_DEPTH = 1  # a zip in the download (a student's, or in a folder): opened; one inside: not
# The share of this version's code cells a submission of it keeps unchanged, at least: a
# learner edits a few cells; the course's own history (git log notebooks/) drifts past
# this within a few months (notebook 01: 13 of 27 cells kept, 03: 11 of 18).
SAME_VERSION = 0.8
REPORT = "COLLECTED.md"
_MOODLE = re.compile(r"^(.+?)_(\d+)_assignsubmission_[a-z]+_?$", re.IGNORECASE)
_CANVAS = re.compile(r"^([a-z0-9-]+?)_(late_)?(\d+)_(\d+)_(.+)$", re.IGNORECASE)
_JUNK = ("__MACOSX", ".ipynb_checkpoints", ".DS_Store", ".git")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One file of the download: its path (zip members under the zip's name), time, bytes."""

    parts: tuple[str, ...]
    mtime: float
    read: Callable[[], bytes]

    @property
    def where(self) -> str:
        return "/".join(self.parts)


@dataclasses.dataclass
class Taken:
    student: str
    notebook: str  # the course's name for it, e.g. "03_zero1.ipynb"
    source: str    # the file taken, within the download
    why: str
    version: str = ""  # why it looks like another version of the course ("" when it is this one)


@dataclasses.dataclass
class Collected:
    taken: list[Taken] = dataclasses.field(default_factory=list)
    ignored: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (file, why)

    def report(self) -> str:
        """The instructor's record: what was taken for which notebook and why, and the rest."""
        lines = ["# Collected", "", f"Of two files for one notebook: {RULE}.", "",
                 "| student | notebook | file taken | why |", "| --- | --- | --- | --- |"]
        for t in self.taken:
            why = t.why + (f"; FROM ANOTHER VERSION OF THE COURSE: {t.version}" if t.version
                           else "")
            lines.append(f"| {_cell(t.student)} | {t.notebook} | {_cell(t.source)} | "
                         f"{_cell(why)} |")
        lines += ["", "Ignored:", ""]
        lines += [f"- {_cell(where)}: {why}" for where, why in self.ignored] or ["- nothing"]
        return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def course_notebooks(notebooks: Path = NOTEBOOKS) -> list[str]:
    """The course's notebook names, NN_stem.ipynb (00..10)."""
    return sorted(p.name for p in notebooks.glob("*.ipynb") if re.match(r"\d\d_", p.name))


def match_notebook(filename: str, names: list[str]) -> tuple[str | None, str]:
    """(the course notebook `filename` is a copy of, or None; why), by its prefix and stem."""
    if not filename.lower().endswith(".ipynb"):
        return None, "not a notebook (.ipynb)"
    stem = filename[:-len(".ipynb")]
    hits = []
    for name in names:
        # `_` may have become `-` or a space on the way; the name must stand alone in the
        # file's (`103_zero1x` is not `03_zero1`).
        words = [re.escape(w) for w in re.split(r"[-_ ]", name[:-len(".ipynb")])]
        found = re.search(r"(?<![0-9a-z])" + "[-_ ]".join(words) + r"(?![0-9a-z])", stem,
                          re.IGNORECASE)
        if found:
            hits.append((name, found))
    if not hits:
        return None, "its name holds no course notebook's NN_name"
    if len(hits) > 1:
        return None, f"its name holds two course notebooks ({', '.join(n for n, _ in hits)})"
    name, found = hits[0]
    return name, ("its own name" if filename == name else
                  f"renamed ({filename!r} holds {name[:-len('.ipynb')]})")


def _copy_number(filename: str) -> tuple[int, bool]:
    """The LMS's or browser's copy number (`-2`, ` (2)`; 0 for none) and whether it says late."""
    numbers = re.findall(r"\((\d+)\)|-(\d+)(?=\D*$)", filename)
    copy = max((int(a or b) for a, b in numbers), default=0)
    return copy, "late" in filename.lower()


def _from_folder(folder: Path, ignored: list) -> Iterator[Entry]:
    for path in sorted(folder.rglob("*")):
        parts = path.relative_to(folder).parts
        if path.is_symlink():  # an LMS download has none; following one could read anything
            ignored.append(("/".join(parts), "a symbolic link (not followed)"))
        elif path.is_file() and path.stat().st_size > MAX_BYTES:
            ignored.append(("/".join(parts), f"larger than {MAX_BYTES // 2**20} MB (not read)"))
        elif path.is_file():
            # depth 1, as a zipped download's members: a folder and its zip read alike
            yield from _expand(Entry(parts, path.stat().st_mtime, path.read_bytes), 1, ignored)


def _from_zip(data: bytes, prefix: tuple[str, ...], depth: int, ignored: list) -> Iterator[Entry]:
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        if not prefix:  # the download itself: nothing to collect
            raise ValueError(f"collect: the download is not a readable zip ({exc})") from None
        ignored.append(("/".join(prefix), f"not a readable zip ({exc})"))
        return
    for info in archive.infolist():
        if info.is_dir():
            continue
        parts = tuple(p for p in re.split(r"[/\\]", info.filename) if p not in ("", "."))
        where = "/".join((*prefix, *parts))
        if ".." in parts:
            ignored.append((where, "a zip member whose path climbs out of the zip (not read)"))
        elif info.file_size > MAX_BYTES:
            ignored.append((where, f"larger than {MAX_BYTES // 2**20} MB (not read)"))
        else:
            mtime = calendar.timegm((*info.date_time, 0, 0, 0))
            entry = Entry((*prefix, *parts), mtime,
                          lambda archive=archive, info=info: archive.read(info)[:MAX_BYTES + 1])
            yield from _expand(entry, depth + 1, ignored)


def _expand(entry: Entry, depth: int, ignored: list) -> Iterator[Entry]:
    """`entry`, or the files in it if it is a zip no deeper than ZIP_DEPTH."""
    if not entry.parts[-1].lower().endswith(".zip"):
        yield entry
    elif depth > ZIP_DEPTH:
        ignored.append((entry.where, f"a zip nested more than {ZIP_DEPTH} level(s) deep "
                                     "(not opened)"))
    else:
        data = _read(entry, ignored)
        if data is not None:
            yield from _from_zip(data, entry.parts, depth, ignored)


def _read(entry: Entry, ignored: list) -> bytes | None:
    """The entry's bytes, or None with the reason said (an encrypted or broken zip member)."""
    try:
        return entry.read()
    except (OSError, RuntimeError, zipfile.BadZipFile, EOFError, zlib.error) as exc:
        ignored.append((entry.where, f"could not be read ({type(exc).__name__}: "
                                     f"{str(exc)[:80]})"))
        return None


def _student(top: str) -> str:
    """The student a top-level folder or zip belongs to: Moodle's name and id, else its name."""
    name = top[:-len(".zip")] if top.lower().endswith(".zip") else top
    moodle = _MOODLE.match(name)
    if moodle:
        name = f"{moodle.group(1)}_{moodle.group(2)}"
    else:
        canvas = _CANVAS.match(name)
        if canvas:
            name = f"{canvas.group(1)}_{canvas.group(3)}"
    return _clean(name)


def _clean(name: str) -> str:
    """A student name safe as one folder name: letters, digits, `.`, `-`, `_`."""
    return re.sub(r"[^\w.-]+", "_", name).strip("._")


def _unwrap(entries: list[Entry]) -> list[Entry]:
    """Look through one wrapper folder (`submissions/`) that holds every student's entry and
    no notebook of its own (a single student's folder holds notebooks)."""
    for _ in range(2):
        if len({e.parts[0] for e in entries}) != 1 or any(
                len(e.parts) < 2 or len(e.parts) == 2 and e.parts[1].lower().endswith(".ipynb")
                and not _CANVAS.match(e.parts[1]) for e in entries):
            break
        entries = [dataclasses.replace(e, parts=e.parts[1:]) for e in entries]
    return entries


def version_note(nb: dict, course: dict) -> str:
    """"" when `nb` keeps this course version's code cells; else what differs. A cell counts as
    kept when one of `nb`'s cells has its text (for an exercise cell: its text outside the
    functions' bodies, what the student copy hands out); a learner edits a few cells, another
    version of the course differs in most. The cell ids kept are said alongside."""
    copy = student_notebook(course)[0]
    mine = code_cells(nb)
    ids = {cid for cid, _ in mine if cid}
    texts = {_norm(src) for _, src in mine}
    kept, total, exercises = 0, 0, []
    for (_, text), (_, original) in zip(code_cells(copy), code_cells(course), strict=True):
        total += 1
        names = _exercise_functions(original)
        if names:
            want = outside_bodies(text, names)
            ok = any(outside_bodies(src, names) == want for _, src in mine)
            exercises += [] if ok else [", ".join(names)]
        else:
            ok = _norm(text) in texts
        kept += ok
    id_share = sum(cid in ids for cid, _ in code_cells(course)) / max(total, 1)
    if total and kept / total < SAME_VERSION:
        return (f"{kept} of this version's {total} code cells are in it unchanged, "
                f"{id_share:.0%} of their cell ids" + (
                    f"; the exercise cell of {'; of '.join(exercises)} differs outside the "
                    "bodies (graded `tampered` unless accepted)" if exercises else ""))
    return ""


def _exercise_functions(source: str) -> tuple[str, ...]:
    """The names of the functions a course cell's solution markers are in."""
    if BEGIN_MARK not in source:
        return ()
    return tuple(re.findall(r"^def (\w+)\(", source, re.MULTILINE))


def _norm(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def collect(download: Path, out: Path, notebooks: Path = NOTEBOOKS) -> Collected:
    """Read `download` (a folder or a .zip), write OUT/<student>/<notebook>.ipynb and
    OUT/COLLECTED.md, and return what was taken and ignored, each with its reason."""
    download = Path(download)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"collect: {out} exists and is not an empty folder (collect "
                              "writes into a new one, so no earlier file is mixed in)")
    names = course_notebooks(notebooks)
    if not names:
        raise FileNotFoundError(f"collect: no course notebooks (NN_*.ipynb) in {notebooks}")
    result = Collected()
    if download.is_dir():
        entries = list(_from_folder(download, result.ignored))
    elif download.is_file() and zipfile.is_zipfile(download):
        entries = list(_from_zip(download.read_bytes(), (), 0, result.ignored))
    else:
        raise FileNotFoundError(f"collect: {download} is neither a folder nor a .zip")
    unwrapped = _unwrap(entries)
    if unwrapped and len(unwrapped[0].parts) < len(entries[0].parts):  # said as it is read
        wrapper = "/".join(entries[0].parts[:len(entries[0].parts) - len(unwrapped[0].parts)])
        result.ignored = [(w.removeprefix(wrapper + "/"), why) for w, why in result.ignored]
    candidates: dict[tuple[str, str], list[tuple[Entry, str]]] = {}
    for entry in unwrapped:
        junk = next((p for p in entry.parts if p in _JUNK or p.startswith("._")), None)
        if junk:
            result.ignored.append((entry.where, f"{junk}: editor or system files, not a "
                                                "submission"))
            continue
        student, filename = _owner(entry.parts)
        if not student:
            result.ignored.append((entry.where, "a file outside any student's folder or zip, "
                                                "and not named as Canvas names one"))
            continue
        notebook, why = match_notebook(filename, names)
        if notebook is None:
            result.ignored.append((entry.where, why))
        else:
            candidates.setdefault((student, notebook), []).append((entry, why))
    out.mkdir(parents=True, exist_ok=True)
    for (student, notebook), found in sorted(candidates.items()):
        _take(student, notebook, found, out, notebooks, result)
    (out / REPORT).write_text(result.report(), encoding="utf-8")
    return result


def _owner(parts: tuple[str, ...]) -> tuple[str, str]:
    """(student, the file's own name) of a file at `parts` in the download."""
    if len(parts) > 1:
        return _student(parts[0]), parts[-1]
    canvas = _CANVAS.match(parts[0])
    return ((_clean(f"{canvas.group(1)}_{canvas.group(3)}"), canvas.group(5)) if canvas
            else ("", parts[0]))


def _take(student: str, notebook: str, found: list, out: Path, notebooks: Path,
          result: Collected) -> None:
    """Write the newest readable candidate as OUT/student/notebook; say why, and of the rest."""
    def newest(item):
        entry = item[0]
        copy, late = _copy_number(entry.parts[-1])
        return entry.mtime, copy, late, entry.where

    readable = []
    for entry, why in sorted(found, key=newest, reverse=True):
        data = _read(entry, result.ignored)
        if data is None:
            continue
        try:
            if len(data) > MAX_BYTES:
                raise ValueError(f"larger than {MAX_BYTES // 2**20} MB")
            readable.append((entry, why, data, json.loads(data.decode("utf-8"))))
        except (UnicodeDecodeError, ValueError) as exc:
            result.ignored.append((entry.where, f"not a readable notebook ({str(exc)[:80]})"))
    if not readable:
        return  # every candidate is in `ignored`, with its reason; the grader says "missing"
    entry, why, data, nb = readable[0]
    for other, _, _, _ in readable[1:]:
        result.ignored.append((other.where, f"an older candidate for {student}/{notebook} "
                                            f"than {entry.where} ({_when(other)} vs "
                                            f"{_when(entry)}; {RULE})"))
    if len(readable) > 1:
        why += f"; the newest of {len(readable)} candidates"
    (out / student).mkdir(exist_ok=True)
    (out / student / notebook).write_bytes(data)  # as submitted, byte for byte
    course = json.loads((notebooks / notebook).read_text(encoding="utf-8"))
    result.taken.append(Taken(student, notebook, entry.where, why, version_note(nb, course)))


def _when(entry: Entry) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(entry.mtime))


def main(argv: list[str] | None = None) -> int:
    """`python -m zero_lab.grading collect DOWNLOAD --out DIR`; returns the exit code."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m zero_lab.grading collect")
    parser.add_argument("download", type=Path, help="the LMS download: a folder or a .zip")
    parser.add_argument("--out", type=Path, required=True,
                        help="a new folder: OUT/<student>/<notebook>.ipynb, OUT/COLLECTED.md")
    args = parser.parse_args(argv)
    try:
        result = collect(args.download, args.out)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    flagged = sum(bool(t.version) for t in result.taken)
    print(f"{len({t.student for t in result.taken})} students, {len(result.taken)} notebooks "
          f"in {args.out}; {len(result.ignored)} files ignored, {flagged} notebooks from "
          f"another course version: {args.out / REPORT} says which and why")
    return 0
