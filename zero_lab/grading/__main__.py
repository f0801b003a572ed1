"""`python -m zero_lab.grading student --out build/student`: write the student copies."""

from zero_lab.grading.student import main

raise SystemExit(main())
