"""The instructor's commands, in the order a course uses them:

    python -m zero_lab.grading student --out build/student      the copies to hand out
    python -m zero_lab.grading collect DOWNLOAD --out DIR        an LMS download, laid out
    python -m zero_lab.grading grade SUBMISSIONS --out DIR       grade a folder (batch.py)
    python -m zero_lab.grading grade --resume DIR                finish a run that was stopped
    python -m zero_lab.grading gradebook GRADES.csv ... [--weights W.csv]   totals, one row a
                                                                 student, runs merged
    python -m zero_lab.grading gradescope build NB ...           Gradescope's autograder zip
    python -m zero_lab.grading soak [--runs 20] [--load 2]       the reference class, graded
                                                                 again and again under load
"""

import argparse
import importlib
import sys
from pathlib import Path

# Each of these modules has its own command line (`main(argv)`).
COMMANDS = {"student": "zero_lab.grading.student", "collect": "zero_lab.grading.collect",
            "gradebook": "zero_lab.grading.gradebook",
            "gradescope": "zero_lab.grading.gradescope", "soak": "zero_lab.grading.soak"}


def grade_main(argv: list[str]) -> int:
    """The `grade` command line; returns the exit code."""
    from zero_lab.grading import jail
    from zero_lab.grading.batch import NoSandbox, grade
    from zero_lab.grading.submissions import read_accepts
    from zero_lab.launch.paths import new_run_dir

    parser = argparse.ArgumentParser(prog="python -m zero_lab.grading grade")
    parser.add_argument("submissions", type=Path, nargs="?",
                        help="SUBMISSIONS/<student>/<notebook>.ipynb")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the reports go (default: a new folder under runs/grades/)")
    parser.add_argument("--seed", type=int, default=0, help="draws the hidden cases' inputs")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="exercises graded at once")
    parser.add_argument("--timeout", type=float, default=1.0,
                        help="scales every exercise's own time limit (2 doubles them)")
    parser.add_argument("--only", default=None, help="notebooks whose name starts with this")
    parser.add_argument("--resume", type=Path, default=None, metavar="DIR",
                        help="finish the run in DIR: its submissions, seed and notebooks, "
                             "grading only the exercises not written there yet")
    parser.add_argument("--accept", action="append", default=[], metavar="STUDENT/NB/EXERCISE",
                        help="grade this tampered exercise cell from the student's definitions "
                             "(summary.md shows each one's diff); repeatable")
    parser.add_argument("--accept-file", action="append", default=[], type=Path, metavar="FILE",
                        help="--accept keys, one a line (# comments allowed)")
    parser.add_argument(jail.UNSAFE_FLAG, dest="unsafe", action="store_true",
                        help="grade even where no sandbox can be made (learner code then "
                             "reaches this user's files, processes and network)")
    args = parser.parse_args(argv)
    if (args.submissions is None) == (args.resume is None):
        parser.error("give SUBMISSIONS, or --resume DIR (not both)")
    out = args.resume or args.out or new_run_dir("grades")
    try:
        accept = read_accepts(args.accept, args.accept_file)
        grade(args.submissions, out, args.seed, args.jobs, args.timeout, args.only,
              unsafe=args.unsafe, resume=args.resume is not None,
              accept=["/".join(key) for key in accept])
    except (FileNotFoundError, ValueError, NoSandbox) as exc:
        print(f"grade: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"grade: interrupted; every exercise it had started was ended. What was graded "
              f"is in {out}/results/: `grade --resume {out}` finishes the run.", file=sys.stderr)
        return 130
    print(f"reports in {out}: grades.csv, summary.md, feedback/, gradescope/, results/")
    return 0


def main(argv: list[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "grade":
        return grade_main(rest)
    if command in COMMANDS:
        return importlib.import_module(COMMANDS[command]).main(rest)
    print(__doc__.strip(), file=sys.stderr)
    return 0 if command in ("-h", "--help") else 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
