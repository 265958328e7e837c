# `make test` and `make run` work on a fresh clone: they create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
# Test processes: most of a test's time is spent waiting on the servers it starts, so more processes
# than cores pay (docs/testing.md).
TEST_PROCESSES ?= 4

.PHONY: test test-pure system compiled run lint sanitize wheel bench clean

# Two stamps in one .venv. `make run` installs what serving needs: the package and its dependencies
# (about 60 MB). `make test` installs the test and Spark extras too (pytest, mypy, PySpark, PyArrow:
# about 840 MB), which is all `make run` needs as well.
# The compiled helpers are built by the install, so a changed C source installs again.
C_SOURCES := $(shell find src -name '*.[ch]')

$(RUN_STAMP): pyproject.toml setup.py $(C_SOURCES)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $(RUN_STAMP)

$(STAMP): pyproject.toml setup.py $(C_SOURCES)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,spark]'
	touch $(RUN_STAMP) $(STAMP)

# The compiled build: the package's wheel (the request path compiled by mypyc from its Python source,
# the C helpers), installed into build/compiled. mypyc's compile takes minutes, so it runs once per
# source: the wheel is kept in build/wheels/ under the hash of every file it is built from (a changed
# or another source makes another), and the suite's install test installs that same wheel
# (tests/server/test_install.py, KESTREL_TEST_WHEEL). The editable install in .venv stays the pure
# build: what `.venv/bin/pytest` runs while developing (docs/testing.md).
COMPILED := build/compiled
WHEEL_INPUTS := $(sort setup.py pyproject.toml README.md $(shell find src -type f ! -name '*.so' \
	! -path '*/__pycache__/*' ! -path '*.egg-info/*' 2>/dev/null))
BUILD_KEY := $(shell (echo $(WHEEL_INPUTS); cat $(WHEEL_INPUTS)) | sha256sum | cut -c1-16)
WHEELS := build/wheels
WHEEL_DIR := $(WHEELS)/$(BUILD_KEY)
# A worker that dies (a crash in C code) ends the run at once, naming the test it ran: pytest-xdist
# 3.8 replaces it otherwise, and under --dist loadgroup the replacement can wait forever.
# A test process that dies of a signal leaves a core dump, whose threads' C stacks are printed, and
# the dump deleted, after the run (tests/support/crash_report.py).
PYTEST := $(BIN)/python tests/support/crash_report.py \
	$(BIN)/pytest -q -n $(TEST_PROCESSES) --dist loadgroup --no-loadscope-reorder --max-worker-restart=0
# The compiled modules' own tests, without servers, run on the pure build as well (a pure server
# serves in tests/server/test_builds.py and, without the C helpers, test_without_compiler.py; the
# whole suite: `make test-pure`). Tests marked `pure_build` run there only (tests/conftest.py).
PURE_TESTS := tests/thrift/test_thrift_codec.py tests/thrift/test_thrift_binary.py tests/thrift/test_thrift_turns.py \
	tests/memcache/test_memcache_protocol.py tests/memcache/test_memcache_runs.py \
	tests/text/test_text_protocol.py tests/text/test_text_connection.py tests/server/test_socket_io.py tests/server/test_builds.py \
	tests/server/test_unexpected_errors.py tests/server/test_dashboard.py tests/server/test_waits_watched.py \
	tests/server/test_stats_render.py tests/server/test_turns.py tests/server/test_hub_turns.py tests/thrift/test_call_arguments.py tests/session \
	tests/storage

# A wheel that came out pure Python (mypyc refused the source, or its C did not compile: setup.py
# then builds pure, as an install without a compiler should) stops the make, with the build's reasons.
# The listing is read to its end (`grep -q` would leave the lister a broken pipe and a traceback).
$(WHEEL_DIR)/.built: $(STAMP)
	rm -rf $(WHEELS)
	mkdir -p $(WHEEL_DIR)
	$(BIN)/pip wheel --verbose --no-deps --no-build-isolation -w $(WHEEL_DIR) . > $(WHEEL_DIR)/build.log 2>&1 \
		|| { tail -n 40 $(WHEEL_DIR)/build.log; exit 1; }
	$(BIN)/python -m zipfile -l $(WHEEL_DIR)/kestrel_py-*.whl | grep kestrel__mypyc > /dev/null \
		|| { grep -E ": error: |stays pure Python" $(WHEEL_DIR)/build.log | tail -n 40; \
		echo "the wheel came out pure Python (why: above; the whole build: $(WHEEL_DIR)/build.log)"; exit 1; }
	touch $@

$(COMPILED)/.built-$(BUILD_KEY): $(WHEEL_DIR)/.built
	rm -rf $(COMPILED)
	$(BIN)/pip install --quiet --no-deps --no-compile --target $(COMPILED) $(WHEEL_DIR)/kestrel_py-*.whl
	touch $@

compiled: $(COMPILED)/.built-$(BUILD_KEY)

# The machine's set-up (tests/support/system.py): Debian packages (a C compiler among them) and small
# file systems, as root; elsewhere it says what is missing and those tests skip.
system: $(STAMP)
	$(BIN)/python tests/support/system.py

# The set-up and the compiled build first; then the whole suite on the compiled build, and the
# compiled modules' tests on the pure build.
test: $(STAMP) system $(COMPILED)/.built-$(BUILD_KEY)
	$(BIN)/ruff check .
	$(BIN)/mypy
	KESTREL_TEST_BUILD=compiled KESTREL_TEST_WHEEL="$$(ls $(CURDIR)/$(WHEEL_DIR)/kestrel_py-*.whl)" \
		PYTHONPATH=$(COMPILED) $(PYTEST)
	KESTREL_TEST_BUILD=pure $(PYTEST) $(PURE_TESTS)

# The whole suite on the pure build.
test-pure: $(STAMP) system
	KESTREL_TEST_BUILD=pure $(PYTEST)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# The C helpers built under AddressSanitizer and UBSan (any undefined behaviour aborts) from a copy
# of src/ in build/sanitize, then the tests that compare each with its Python reference run on that
# build, the interpreter preloading the sanitizer's runtime (it is not built with it itself) and the
# C++ runtime before it (greenlet's switches throw C++ exceptions the sanitizer must intercept).
SANITIZE := build/sanitize
SANITIZE_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1
SANITIZE_TESTS := tests/thrift/test_thrift_binary.py tests/memcache/test_memcache_runs.py \
	tests/storage/test_item.py tests/storage/test_manifest.py tests/storage/test_decode_common.py \
	tests/storage/test_replay_fast_path.py tests/storage/test_batch_paths.py tests/storage/test_group_commit.py \
	tests/storage/test_commit_log.py tests/server/test_socket_io.py tests/server/test_item_copies.py \
	tests/storage/test_disk_write.py tests/storage/test_clock.py tests/storage/test_kestrel3_decode_puts.py
# Then the compiled build (mypyc's request path and the helpers) under AddressSanitizer, from a
# wheel built in build/sanitize-compiled, with the storage and session tests: Python's own allocator
# off (PYTHONMALLOC=malloc), so that an object freed while compiled code still uses it is freed
# memory the sanitizer sees (unless the interpreter keeps freed objects of its type for reuse, as it
# does lists and tuples). Heap only: greenlet switches by copying C stacks, which would read the
# redzones of instrumented frames.
SANITIZE_COMPILED := build/sanitize-compiled
SANITIZE_COMPILED_FLAGS := -fsanitize=address --param asan-stack=0 -fno-omit-frame-pointer -g -O1
CC ?= cc
SANITIZER_PRELOAD = LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libstdc++.so)"

# A copy of the source in folder $(1) for a build of its own, without helpers built in src/.
define copy_source
rm -rf $(1) && mkdir -p $(1)
cp -r setup.py pyproject.toml README.md src $(1)/
find $(1)/src -name '*.so' -delete
endef

sanitize: $(STAMP)
	$(call copy_source,$(SANITIZE))
	cd $(SANITIZE) && CC=$(CC) CFLAGS="$(SANITIZE_FLAGS)" LDFLAGS="$(SANITIZE_FLAGS)" \
		$(CURDIR)/$(BIN)/python setup.py --quiet build_ext --inplace
	test "$$(find $(SANITIZE)/src -name '*.so' | wc -l)" -eq "$$(find src -name '*.c' | wc -l)"  # each one built
	PYTHONPATH=$(SANITIZE)/src $(BIN)/python -c "import kestrel; assert '$(SANITIZE)/' in kestrel.__file__"
	PYTHONPATH=$(SANITIZE)/src ASAN_OPTIONS=detect_leaks=0 $(SANITIZER_PRELOAD) \
		$(BIN)/python -m pytest -q -p no:cacheprovider -n 0 $(SANITIZE_TESTS)
	rm -rf $(SANITIZE_COMPILED)
	$(call copy_source,$(SANITIZE_COMPILED)/source)
	cd $(SANITIZE_COMPILED)/source && CC=$(CC) CFLAGS="$(SANITIZE_COMPILED_FLAGS)" LDFLAGS="-fsanitize=address" \
		$(CURDIR)/$(BIN)/pip wheel --quiet --no-deps --no-build-isolation -w ../wheel .
	$(BIN)/pip install --quiet --no-deps --no-compile --target $(SANITIZE_COMPILED)/build $(SANITIZE_COMPILED)/wheel/kestrel_py-*.whl
	PYTHONPATH=$(SANITIZE_COMPILED)/build KESTREL_TEST_BUILD=compiled PYTHONMALLOC=malloc ASAN_OPTIONS=detect_leaks=0 \
		$(SANITIZER_PRELOAD) $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_PROCESSES) --dist loadgroup tests/storage tests/session

run: $(RUN_STAMP)
	$(BIN)/kestrel serve

# The installable wheel (the Thrift contract included) in dist/; README: Operations.
wheel: $(RUN_STAMP)
	$(BIN)/pip wheel . --no-deps --quiet -w dist

# Never var/: it holds the queues `make run` serves.
clean:
	rm -rf $(VENV) dist build
