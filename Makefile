# Set-up and common jobs. `make test` and `make demo` install everything they need first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install lint test demo docs mutate clean

# torch first, pinned: on these machines torch==2.13.0 is a CPU build on local disk; any other spec
# pulls a multi-GB CUDA build. Elsewhere the same pin is the normal wheel from PyPI. Everything else is
# pinned by constraints.txt: CI tests the versions it names, not whatever PyPI released that day.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,demo]' -c constraints.txt
	touch $@

install: $(VENV)/.installed

# ruff (style, and PLR0915: a function over 50 statements), then the package's layer contracts
# (pyproject.toml [tool.importlinter]), then a soft report of modules over 600 lines (printed, not failing).
lint: install
	$(VENV)/bin/ruff check cembed tests scripts
	$(VENV)/bin/ruff format --check cembed tests scripts
	$(VENV)/bin/lint-imports --no-cache
	@find cembed -name '*.py' | xargs wc -l | awk '$$2 != "total" && $$1 > 600 {print "note: " $$2 " has " $$1 " lines (over 600: one concept still?)"}'

# Two pytest-xdist workers, a test file at a time on each (--dist loadfile: a module's shared fixture, such
# as the elastic runs, is built once): CI has 2 cores, and most slow tests are one process's Python (a CLI
# run's imports, a tiny model's steps) that leaves the other core idle. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

demo: install
	$(VENV)/bin/cembed train configs/quickstart.yaml

# Mutation testing (mutmut 3, pyproject.toml [tool.mutmut]): the modules issue 32 landed, each mutant
# run against the fast tests that reach its function, one worker at a time (nice, one torch thread: it
# shares a 2-core machine), then a per-module table and every surviving mutant (scripts/mutation_report.py).
# Verdicts are cached in mutants/ (only changed functions rerun); `rm -rf mutants` for a run from scratch.
# From scratch on 2 shared cores this takes well over an hour (docs/development.md has the measured times).
mutate: install
	OMP_NUM_THREADS=1 nice -n 19 $(VENV)/bin/mutmut run --max-children 1
	$(PY) scripts/mutation_report.py

# The documentation site into site/ (mkdocs.yml); the reference pages are regenerated from the code first.
docs: install
	$(PIP) install -q -e '.[docs]' -c constraints.txt
	$(PY) scripts/gen_reference.py
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) runs site
