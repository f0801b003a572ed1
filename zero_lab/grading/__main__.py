"""`python -m zero_lab.grading student --out build/student`: write the student copies;
`python -m zero_lab.grading grade SUBMISSIONS --out DIR`: grade a folder of them (batch.py);
`python -m zero_lab.grading grade --resume DIR`: finish a run that was stopped."""

import argparse
import sys
from pathlib import Path


def grade_main(argv: list[str]) -> int:
    """The `grade` command line; returns the exit code."""
    from zero_lab.grading import jail
    from zero_lab.grading.batch import NoSandbox, grade
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
    parser.add_argument(jail.UNSAFE_FLAG, dest="unsafe", action="store_true",
                        help="grade even where no sandbox can be made (learner code then "
                             "reaches this user's files, processes and network)")
    args = parser.parse_args(argv)
    if (args.submissions is None) == (args.resume is None):
        parser.error("give SUBMISSIONS, or --resume DIR (not both)")
    out = args.resume or args.out or new_run_dir("grades")
    try:
        grade(args.submissions, out, args.seed, args.jobs, args.timeout, args.only,
              unsafe=args.unsafe, resume=args.resume is not None)
    except (FileNotFoundError, ValueError, NoSandbox) as exc:
        print(f"grade: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"grade: interrupted; every exercise it had started was ended. What was graded "
              f"is in {out}/results/: `grade --resume {out}` finishes the run.", file=sys.stderr)
        return 130
    print(f"reports in {out}: grades.csv, summary.md, feedback/, gradescope/, results/")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["grade"]:
        raise SystemExit(grade_main(sys.argv[2:]))
    from zero_lab.grading.student import main

    raise SystemExit(main())
