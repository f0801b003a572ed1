"""`python -m zero_lab.grading student --out build/student`: write the student copies;
`python -m zero_lab.grading grade SUBMISSIONS --out DIR`: grade a folder of them (batch.py)."""

from zero_lab.grading.student import main

raise SystemExit(main())
