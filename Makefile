# Set-up and checks. `make test` and `make demo` build .venv from scratch when it is missing.
PYTHON ?= python3.11
VENV := .venv
VENV_251 := .venv-lightning-2.5.1
PIP_FLAGS := --quiet --disable-pip-version-check
# The scenarios marked lightning251, run by the 2.5.1 venv's Python (the version is asserted).
PYTEST_251 := SCENARIO_PYTHON=$(CURDIR)/$(VENV_251)/bin/python SCENARIO_EXPECT_LIGHTNING=2.5.1 \
	$(VENV)/bin/python -m pytest -ra -m lightning251 tests/test_scenarios.py

.PHONY: test test-unit test-scenarios test-lightning-2.5.1 demo clean

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

venv: $(VENV)/.installed

# The whole suite: unit tests, the multi-process scenario matrix, then the lightning 2.5.1 subset.
test: $(VENV)/.installed $(VENV_251)/.installed
	$(VENV)/bin/python -m pytest -ra
	$(PYTEST_251)

test-unit: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -ra -m "not scenario"

test-lightning-2.5.1: $(VENV)/.installed $(VENV_251)/.installed
	$(PYTEST_251)

demo: $(VENV)/.installed
	$(VENV)/bin/python demo/demo.py

clean:
	rm -rf $(VENV) $(VENV_251) build dist src/*.egg-info .pytest_cache
