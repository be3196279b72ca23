# Set-up and checks. `make test` and `make demo` build .venv from scratch when it is missing.
# PYTHON=... VENV=... build and use another interpreter's venv (.ci/run: the soak on Python 3.12).
PYTHON ?= python3.11
VENV ?= .venv
VENV_251 := .venv-lightning-2.5.1
VENV_PATCHED := .venv-patched
SERIES := patches/lightning-2.6.6
PATCHED_WHEEL := dist/lightning-2.6.6+ddpsigterm-py3-none-any.whl
PIP_FLAGS := --quiet --disable-pip-version-check
# The scenarios marked lightning251, run by the 2.5.1 venv's Python (the version is asserted).
PYTEST_251 := SCENARIO_PYTHON=$(CURDIR)/$(VENV_251)/bin/python SCENARIO_EXPECT_LIGHTNING=2.5.1 \
	$(VENV)/bin/python -m pytest -ra -m lightning251 tests/test_scenarios.py
# The scenarios (and the Trainer example) marked patched, run by the patched Lightning (no ddp_sigterm there;
# the version is asserted), then the test the patch series adds to Lightning's own suite.
PYTEST_PATCHED := SCENARIO_PYTHON=$(CURDIR)/$(VENV_PATCHED)/bin/python SCENARIO_IMPLEMENTATION=patched \
	SCENARIO_EXPECT_LIGHTNING=2.6.6+ddpsigterm $(VENV)/bin/python -m pytest -ra -m patched tests/test_scenarios.py \
	tests/test_examples.py
PYTEST_LIGHTNING_TEST := $(VENV_PATCHED)/bin/python -m pytest -ra -p no:cacheprovider \
	build/lightning-2.6.6/tests/tests_pytorch/trainer/connectors/test_sigterm_ddp.py

# Lightning's own tests (the release sdist has none), stock and with the package: see tests/upstream_suite.py.
LIGHTNING_TESTS ?= $(firstword $(wildcard ../shared/upstream/lightning-2.6.5-tests.tar.gz \
	/work/shared/upstream/lightning-2.6.5-tests.tar.gz))
LIGHTNING_TEST_FILES := tests_pytorch/trainer/connectors/test_signal_connector.py \
	tests_pytorch/trainer/connectors/test_callback_connector.py tests_pytorch/loops \
	tests_pytorch/utilities/test_auto_restart.py

.PHONY: test test-unit test-lightning-2.5.1 test-lightning patched-lightning test-patched soak bench demo clean

$(VENV)/.installed: pyproject.toml requirements/constraints.txt requirements/test.txt
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
	$(VENV)/bin/pip install $(PIP_FLAGS) -c requirements/constraints.txt torch
	$(VENV)/bin/pip install $(PIP_FLAGS) -c requirements/constraints.txt -r requirements/test.txt -e .
	touch $@

$(VENV_251)/.installed: pyproject.toml requirements/constraints-lightning-2.5.1.txt
	rm -rf $(VENV_251)
	$(PYTHON) -m venv $(VENV_251)
	$(VENV_251)/bin/pip install $(PIP_FLAGS) -c requirements/constraints-lightning-2.5.1.txt torch
	$(VENV_251)/bin/pip install $(PIP_FLAGS) -c requirements/constraints-lightning-2.5.1.txt -e .
	touch $@

# Lightning 2.6.6 with patches/ applied (see patches/build.sh), built into dist/ and installed alone.
$(VENV_PATCHED)/.installed: patches/build.sh $(SERIES)/series $(wildcard $(SERIES)/*.patch) \
		requirements/constraints.txt requirements/test.txt
	rm -rf $(VENV_PATCHED)
	$(PYTHON) -m venv $(VENV_PATCHED)
	$(VENV_PATCHED)/bin/pip install $(PIP_FLAGS) -c requirements/constraints.txt torch
	bash patches/build.sh $(VENV_PATCHED)/bin/python
	# the patched wheel and the test tools only: ddp_sigterm is deliberately not installed here
	$(VENV_PATCHED)/bin/pip install $(PIP_FLAGS) -c requirements/constraints.txt -r requirements/test.txt $(PATCHED_WHEEL)
	touch $@

venv: $(VENV)/.installed

patched-lightning: $(VENV_PATCHED)/.installed

# The whole suite: unit tests, the multi-process scenario matrix, then the lightning 2.5.1 subset.
test: $(VENV)/.installed $(VENV_251)/.installed
	$(VENV)/bin/python -m pytest -ra
	$(PYTEST_251)

test-unit: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -ra -m "not scenario"

test-lightning-2.5.1: $(VENV)/.installed $(VENV_251)/.installed
	$(PYTEST_251)

# Lightning's tests of the signal connector, callback connector, loops and auto-restart, with the package installed:
# every test must end as it does on stock Lightning, but for the accepted differences listed in the script.
test-lightning: $(VENV)/.installed
	@test -n "$(LIGHTNING_TESTS)" || { echo "error: Lightning's tests (lightning-2.6.5-tests.tar.gz) not found in" \
		"../shared/upstream/: set LIGHTNING_TESTS=<path of the archive>" >&2; exit 1; }
	$(VENV)/bin/python tests/upstream_suite.py --archive $(LIGHTNING_TESTS) --into build $(LIGHTNING_TEST_FILES)

test-patched: $(VENV)/.installed $(VENV_PATCHED)/.installed
	$(PYTEST_PATCHED)
	$(PYTEST_LIGHTNING_TEST)

# Randomized fault soak: N real jobs, each stopped by a random fault, then resumed (tests/soak.py).
# SEED=S replays a soak; RECORD=docs/reliability.md writes its summary there.
N ?= 10
soak: $(VENV)/.installed
	$(VENV)/bin/python tests/soak.py $(N) $(if $(SEED),--seed $(SEED)) $(if $(RECORD),--record $(RECORD))

# Benchmarks (not a test: minutes of measurement). Writes docs/benchmarks.md and its plot.
$(VENV)/.bench-installed: $(VENV)/.installed requirements/bench.txt
	$(VENV)/bin/pip install $(PIP_FLAGS) -r requirements/bench.txt
	touch $@

bench: $(VENV)/.bench-installed $(VENV_PATCHED)/.installed
	$(VENV)/bin/python benchmarks/bench.py

demo: $(VENV)/.installed
	$(VENV)/bin/python demo/demo.py

clean:
	rm -rf $(VENV) .venv-py3.* $(VENV_251) $(VENV_PATCHED) build dist src/*.egg-info .pytest_cache
