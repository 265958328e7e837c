# `make test` and `make run` work on a fresh clone: they create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
# Test processes: most of a test's time is spent waiting on the servers it starts, so more processes
# than cores pay (docs/testing.md).
TEST_PROCESSES ?= 4

.PHONY: test run lint wheel bench clean

# Two stamps in one .venv. `make run` installs what serving needs: the package and its dependencies
# (about 60 MB). `make test` installs the test and Spark extras too (pytest, mypy, PySpark, PyArrow:
# about 840 MB), which is all `make run` needs as well.
$(RUN_STAMP): pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $(RUN_STAMP)

$(STAMP): pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,spark]'
	touch $(RUN_STAMP) $(STAMP)

# The machine's set-up first (tests/support/system.py): Debian packages and small file systems, as
# root; elsewhere it says what is missing and those tests skip.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python tests/support/system.py
	$(BIN)/pytest -q -n $(TEST_PROCESSES) --dist loadgroup --no-loadscope-reorder

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

run: $(RUN_STAMP)
	$(BIN)/kestrel serve

# The installable wheel (the Thrift contract included) in dist/; README: Operations.
wheel: $(RUN_STAMP)
	$(BIN)/pip wheel . --no-deps --quiet -w dist

# Never var/: it holds the queues `make run` serves.
clean:
	rm -rf $(VENV) dist build
