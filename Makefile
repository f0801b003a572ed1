# zero-lab: every course task is one target here. `make help` lists them.
# Knobs for run/figures: NPROC (ranks per multi-rank cell), BACKEND (auto|gloo|nccl),
# DEVICE (auto|cpu|cuda: cpu runs every launch on gloo, even beside GPUs; cuda runs NCCL and is
# refused without a GPU per rank; auto follows BACKEND), ONLY (run only notebooks whose name
# starts with this, e.g. ONLY=03).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2
BACKEND ?= auto
DEVICE ?= auto
ONLY ?=
# Knobs for soak: NB (notebooks whose name starts with this; all if empty), RUNS, LOAD.
NB ?=
RUNS ?= 50
LOAD ?= 2
COURSE_ARGS := --nproc $(NPROC) --backend $(BACKEND) --device $(DEVICE) $(if $(ONLY),--only $(ONLY))

.DEFAULT_GOAL := help
.PHONY: help setup lab run figures test soak student grade bench gpu-check deepspeed clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

setup: $(VENV)/.installed ## create .venv and install the package (editable) with dev extras

# Re-installs only when the pins change, so `make setup` is idempotent and fast when current.
# pip compiles what it installs on one core (about 35 s of a 65 s install on 2 cores);
# compileall -j 0 compiles on every core (15 s). Like pip, it skips a file that is not this
# Python's syntax (torch ships one written for 3.12), hence -qq and `|| true`.
# Two makes at once on a fresh clone (`make run` in two terminals) both find .installed out of
# date and would install into the same $(VENV) together: the install runs under an exclusive
# lock on $(VENV)/.setup.lock, and the make that waited checks .installed again under it and,
# finding it current, installs nothing. flock(1) is util-linux's; where it is missing (macOS),
# Python's fcntl.flock takes the same lock (its file kept in `f`: freed, it would unlock).
SETUP_LOCK = $(if $(shell command -v flock 2>/dev/null),flock,$(PYTHON) -c 'import fcntl, \
    subprocess, sys; f = open(sys.argv[1], "a"); fcntl.flock(f, fcntl.LOCK_EX); \
    sys.exit(subprocess.call(sys.argv[2:]))')
$(VENV)/.installed: pyproject.toml
	@mkdir -p $(VENV)
	@$(SETUP_LOCK) $(VENV)/.setup.lock sh -c 'if [ -e $@ ] && ! [ pyproject.toml -nt $@ ]; \
	  then echo "$(VENV) is current: another make setup installed it meanwhile"; exit 0; fi; \
	  set -ex; \
	  $(PYTHON) -m venv $(VENV); \
	  $(PY) -m pip install --quiet --disable-pip-version-check --no-compile -e ".[dev]"; \
	  $(PY) -m compileall -qq -j 0 $(VENV)/lib || true; \
	  touch $@'

# Jupyter refuses to start as root without --allow-root; GPU containers often run as root.
lab: setup ## open the notebooks in JupyterLab (kernel from .venv)
	$(VENV)/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

run: setup ## execute every notebook in order with papermill into a run folder of its own (runs/course/...)
	$(PY) -m zero_lab.course run $(COURSE_ARGS)

figures: setup ## run, then copy the figures the notebooks saved into figures/
	$(PY) -m zero_lab.course figures $(COURSE_ARGS)

# tests/test_browser.py runs these notebooks cell by cell in JupyterLab and fails on any error
# output (and on a cell left unrun): where Chromium is on PATH it does, so nbval runs the others
# and each notebook runs once; without Chromium the browser test skips and nbval runs them all.
BROWSER_TESTS := tests/test_browser.py
BROWSER_NOTEBOOKS := notebooks/00_setup.ipynb notebooks/01_memory_accounting.ipynb
NBVAL_BESIDE_BROWSER := $(filter-out $(BROWSER_NOTEBOOKS),$(wildcard notebooks/*.ipynb))
# A third process runs beside the two (`make test` below), so that three lanes of about equal
# work share the 2 cores to the end: the tests that mostly wait (a launch held until its time
# limit, ranks asleep or hung on purpose, kernels and make runs started and waited for), whose
# waits then overlap the others' work, the grader's tests on rank exercises, notebook 10's and
# the practice script's, the browser test, the checkpoint tests, the judges' and the launcher's
# (none reads the launches pytest's lane shares: tests/common.py; a lane started in the
# background gets SIGINT ignored, which tests/conftest.py undoes). Measured alone on 2 idle
# cores (wall, busy CPU of the whole machine): test_grading_hangs 25.7 s, 9.8 s;
# test_launch_orphans 21.0 s, 9.5 s; test_launch's hang test 17.1 s, 8.0 s; test_course 31.6 s,
# 17.8 s. Clean-clone CI runs: two lanes, 782 s (pytest 736 s, nbval 716 s); with the waiting
# tests third, 731 s (685, 675, 115 s); with the rank grading tests there too, 733 s (686,
# 666, 224 s, the cores 86% busy): a lane that ends early leaves cores idle; with notebook
# 10's, the practice script's, the checkpoint tests and the judges' there too, 708 s (626,
# 670, 490 s); with the browser test and two more launcher tests there too (as below), 651 s
# (608, 581, 598 s).
WAITING_TESTS := tests/test_grading_hangs.py tests/test_launch_orphans.py tests/test_course.py \
    tests/test_packaging.py
RANK_GRADING_TESTS := tests/test_grade_batch_ranks.py tests/test_grading_sandbox_ranks.py \
    tests/test_grading_forged.py tests/test_grading_seeds.py
# Notebook 10's test runs that notebook's cells on a launch of its own.
NOTEBOOK_TESTS := tests/test_nb10_at_work.py
PRACTICE_TESTS := tests/test_fsdp2_script.py
LAUNCHING_TESTS := tests/test_checkpoint.py tests/test_checkpoint_concurrent.py \
    tests/test_checkpoint_jobs.py tests/test_checkpoint_copies.py tests/test_launch.py \
    tests/test_launch_lifetime.py tests/test_launch_deaths.py
JUDGE_TESTS := tests/test_grading_stages.py tests/test_grading_ring.py tests/test_grading_zero3.py
SIDE_TESTS := $(BROWSER_TESTS) $(WAITING_TESTS) $(RANK_GRADING_TESTS) $(NOTEBOOK_TESTS) \
    $(PRACTICE_TESTS) $(LAUNCHING_TESTS) $(JUDGE_TESTS)
SIDE_LOG ?= runs/side.log
NOT_PYTESTS_LANE := $(addprefix --ignore=,$(SIDE_TESTS))

# pytest and nbval run at the same time, one process each: nbval's work fills the cores while
# pytest waits on launches and timeouts, instead of starting after it. nbval writes to
# NBVAL_LOG, shown when pytest ends, so neither's lines break the other's (`tail -f
# runs/nbval.log` to watch it).
# The side tests run in a third process beside both (above), their output in SIDE_LOG, shown
# last. Any of the three failing fails `make test`. What they could write is kept apart:
# the tests save figures in a folder of their own (tests/conftest.py), %%rank_script replaces
# a worker script whole, and no two notebooks save the same one (tests/test_notebook_cells.py).
# pytest exits 5 when it collects nothing; that is not a failure of the code under test.
NBVAL_LOG ?= runs/nbval.log
# Chromium for tests/test_browser.py, bubblewrap for the grader's sandbox: each installed where
# apt-get and root allow (tests/ensure_package.sh).
ENSURE_CHROMIUM ?= sh tests/ensure_package.sh chromium chromium tests/test_browser.py
ENSURE_BWRAP ?= sh tests/ensure_package.sh bwrap bubblewrap "the grader's sandbox" \
    "no bwrap (bubblewrap) here: the grader refuses to run without it (or with \
    --unsafe-no-sandbox), and the sandbox tests fail; install bubblewrap"
# OpenMP's threads spin while they wait for work, by default: a process with a thread per core
# beside another busy one loses its cores to spinning. Notebook 07's one-process memory run (2
# threads) took 78 s beside two busy processes and 16 s with waiting threads asleep (PASSIVE),
# 12 s alone. The lanes below are each other's busy neighbours, and every kernel, pytest
# process and rank inherits this.
test: export OMP_WAIT_POLICY = PASSIVE
test: setup ## ruff, then pytest on tests/, nbval on every notebook and the side tests at once (CPU)
	$(VENV)/bin/ruff check zero_lab tests
	@$(ENSURE_CHROMIUM)
	@$(ENSURE_BWRAP)
	@mkdir -p $(dir $(NBVAL_LOG)) $(dir $(SIDE_LOG))
	@if command -v chromium >/dev/null 2>&1; then \
	    echo "nbval: $(BROWSER_NOTEBOOKS) run in $(BROWSER_TESTS)"; \
	    set -- $(NBVAL_BESIDE_BROWSER); else set -- notebooks/; fi; \
	echo "$(PY) -m pytest --nbval-lax -p no:cacheprovider $$* >$(NBVAL_LOG) (beside pytest)"; \
	$(PY) -m pytest --nbval-lax -p no:cacheprovider --durations=12 "$$@" >$(NBVAL_LOG) 2>&1 & nbval=$$!; \
	echo "$(PY) -m pytest $(SIDE_TESTS) >$(SIDE_LOG) (beside both)"; \
	$(PY) -m pytest -p no:cacheprovider --durations=12 $(SIDE_TESTS) >$(SIDE_LOG) 2>&1 & side=$$!; \
	trap 'kill $$nbval $$side 2>/dev/null' INT TERM; \
	echo "$(PY) -m pytest tests $(NOT_PYTESTS_LANE)"; \
	$(PY) -m pytest tests $(NOT_PYTESTS_LANE) --durations=25; tests=$$?; \
	wait $$nbval; notebooks=$$?; wait $$side; sided=$$?; \
	echo "============= nbval, run beside pytest ($(NBVAL_LOG)) ============="; \
	cat $(NBVAL_LOG); \
	echo "============= the side tests, run beside both ($(SIDE_LOG)) ============="; \
	cat $(SIDE_LOG); \
	[ $$tests -eq 5 ] && tests=0; [ $$notebooks -eq 5 ] && notebooks=0; [ $$sided -eq 5 ] && sided=0; \
	echo "make test: pytest exit status $$tests, nbval exit status $$notebooks, side tests exit status $$sided"; \
	[ $$tests -eq 0 ] && [ $$notebooks -eq 0 ] && [ $$sided -eq 0 ]

# A check that fails on a busy machine is a defect: soak runs each notebook RUNS times under
# nbval with LOAD CPU-bound processes beside it and prints the pass count per notebook.
soak: setup ## run notebooks RUNS times under nbval beside LOAD busy processes (NB=06 RUNS=50 LOAD=2)
	$(PY) -m zero_lab.course.soak --runs $(RUNS) --load $(LOAD) $(if $(NB),--only $(NB))

student: setup ## write student copies (solutions replaced by stubs) to build/student/
	$(PY) -m zero_lab.grading student --out build/student

# Knobs for grade: SUBMISSIONS (a folder of <student>/<notebook>.ipynb), SEED, JOBS.
grade: setup ## grade SUBMISSIONS=<folder of student folders> into runs/grades/<run>/ (SEED=0 JOBS=2)
	@test -n "$(SUBMISSIONS)" || { echo "make grade SUBMISSIONS=<folder>: which folder?"; exit 2; }
	@$(ENSURE_BWRAP)
	$(PY) -m zero_lab.grading grade "$(SUBMISSIONS)" --seed $(or $(SEED),0) -j $(or $(JOBS),2)

bench: setup ## benchmark DDP, ZeroRedundancyOptimizer and zero_lab stages into a folder of its own under runs/bench/
	$(PY) -m zero_lab.course.bench

# NPROC's `?= 2` above is make run's default: here it would ask for 2 GPUs on a one-GPU machine
# and fail every notebook. gpu_check picks the ranks itself (one per GPU, at most 2; a notebook
# that needs more is a skip) unless NPROC comes from the command line or the environment.
GPU_CHECK_NPROC = $(if $(filter-out file,$(origin NPROC)),$(if $(NPROC),--nproc $(NPROC)))
gpu-check: setup ## on a machine with an NVIDIA GPU: tests/test_cuda.py and every notebook on NCCL, one table (NPROC: ranks; default one per GPU, up to 2)
	$(PY) -m zero_lab.course.gpu_check $(GPU_CHECK_NPROC)

# DeepSpeed is an extra (pyproject.toml says why): installed into .venv on demand, then its
# checks, which `make test` skips where it is missing.
deepspeed: setup ## install DeepSpeed 0.19.8 and check zero_lab/practice/deepspeed/'s configs with it
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev,deepspeed]"
	$(PY) -m pytest -p no:cacheprovider tests/test_deepspeed_configs.py tests/test_finding_persistence.py

clean: ## remove executed notebooks, run outputs, student copies and caches (keeps .venv)
	rm -rf runs build notebooks/workers .pytest_cache .ruff_cache
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +
