"""`python -m zero_lab.course run ...`: the course runner (runner.py)."""

from zero_lab.course.runner import main

main()
