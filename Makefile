# Set-up and checks. `make test` and `make demo` build .venv from scratch when it is missing.
# Python 3.12 (tools/python.sh finds it on the PATH or under pyenv): this machine's 3.11.7 has CPython's fork bug
# gh-112275, a DataLoader worker that can hang in fork() with or without the package, so a hang there proves nothing.
# PYTHON=... VENV=... build and use another interpreter's venv (.ci/run: the 3.11 stage).
PYTHON ?= $(shell bash tools/python.sh 3.12)
VENV ?= .venv
VENV_PATCHED := .venv-patched
# The release the patch series is built on: patches/build.sh pins it (with its sha256).
PATCHED_RELEASE := $(shell sed -n 's/^VERSION=//p' patches/build.sh)
SERIES := patches/lightning-$(PATCHED_RELEASE)
PATCHED_WHEEL := dist/lightning-$(PATCHED_RELEASE)+ddpsigterm-py3-none-any.whl
PIP_FLAGS := --quiet --disable-pip-version-check
# The jobs of make test, test-extended, test-versions and test-patched run WORKERS at a time (pytest-xdist): a job
# keeps a core busy only part of its time (start-up, checkpoints, a signal's wait). SLURM and the network namespaces
# run one at a time (one cluster, one set of nodes).
WORKERS ?= 2
PYTEST := -m pytest -ra -n $(WORKERS)
# The Lightning releases make test-versions runs on (lightning and pytorch_lightning, each venv has both): those the
# package's Lightning internals were checked against, listed once, as CHECKED in $(INTERNALS) (README.md says why
# each). VERSIONS=<release> runs one of them, as each job of the CI's matrix does.
INTERNALS := src/ddp_sigterm/_lightning/internals.py
VERSIONS := $(shell sed -n 's/^CHECKED *= *(\(.*\)).*/\1/p' $(INTERNALS) | tr -d '",')
# The release requirements/constraints.txt pins is in $(VENV) already: make test-versions runs it there, and builds a
# venv of its own for each other release.
PINNED := $(shell sed -n 's/^lightning==//p' requirements/constraints.txt)
release_venv = $(if $(filter $(PINNED),$(1)),$(VENV),.venv-lightning-$(1))
TORCH := $(shell sed -n 's/^torch==//p' requirements/constraints.txt)
# The scenarios (and the Trainer example) marked patched, run by the patched Lightning (no ddp_sigterm there;
# the version is asserted), then the test the patch series adds to Lightning's own suite.
PYTEST_PATCHED := SCENARIO_PYTHON=$(CURDIR)/$(VENV_PATCHED)/bin/python SCENARIO_IMPLEMENTATION=patched \
	SCENARIO_EXPECT_LIGHTNING=$(PATCHED_RELEASE)+ddpsigterm $(VENV)/bin/python $(PYTEST) -m patched \
	tests/test_scenarios.py tests/test_examples.py
# Lightning's own tests of what the series changes, from its 2.6.5 tests with the series' tests/ hunks applied
# (patches/build.sh --tests): the test_auto_restart_under_signal cases, the signal connector's tests, the
# SIGTERMException's tests, PR 1's and PR 7's multi-process tests (test_ddp_sigterm_handling.py,
# test_ddp_sigterm_evaluation.py), and fabric's test_distributed.py (run apart: another conftest). Run from the tests/
# folder, as Lightning's CI does, by the patched build alone.
RELEASE_TESTS := build/lightning-$(PATCHED_RELEASE)-tests/tests
RELEASE_PYTEST := OMP_NUM_THREADS=1 $(CURDIR)/$(VENV_PATCHED)/bin/python -m pytest -ra -p no:cacheprovider
PYTEST_LIGHTNING_TEST := cd $(RELEASE_TESTS) && $(RELEASE_PYTEST) tests_pytorch/utilities/test_auto_restart.py \
	tests_pytorch/trainer/connectors/test_signal_connector.py tests_pytorch/utilities/test_exceptions.py \
	tests_pytorch/trainer/test_ddp_sigterm_handling.py tests_pytorch/trainer/test_ddp_sigterm_evaluation.py \
	&& $(RELEASE_PYTEST) tests_fabric/utilities/test_distributed.py

# Lightning's sources that no package index has: its tests (the release sdist has none), its master snapshot and the
# open upstream pull requests' diffs, in one folder; make fetch-upstream builds what it lacks from Lightning's git
# repository at the commits it pins (tools/fetch_upstream.sh says what each is). LIGHTNING_SOURCES=<folder> points
# elsewhere (.ci/run: the folder this machine keeps them in); LIGHTNING_TESTS, LIGHTNING_MASTER and OPEN_PRS name one
# item each.
LIGHTNING_SOURCES ?= build/lightning-sources
# Lightning's own tests, stock and with the package: see tools/upstream_suite.py.
# $(call ARCHIVE,master|tests): that archive's path in $(LIGHTNING_SOURCES), named where its commit is pinned.
ARCHIVE = $(shell bash tools/fetch_upstream.sh --path $(1) $(LIGHTNING_SOURCES))
LIGHTNING_TESTS ?= $(wildcard $(call ARCHIVE,tests))
# The first line of a recipe that needs them (test-lightning, test-patched): stops it when the archive is missing.
NEED_LIGHTNING_TESTS = @test -n "$(LIGHTNING_TESTS)" || { echo "error: Lightning's tests" \
	"($(notdir $(call ARCHIVE,tests))) not found in $(LIGHTNING_SOURCES)/:" \
	"make fetch-upstream builds it there, or set" \
	"LIGHTNING_SOURCES=<its folder>" >&2; exit 1; }
LIGHTNING_TEST_FILES := tests_pytorch/trainer/connectors/test_signal_connector.py \
	tests_pytorch/trainer/connectors/test_callback_connector.py tests_pytorch/loops \
	tests_pytorch/utilities/test_auto_restart.py

# Lightning's master snapshot (source and tests), unpacked three times into $(UPSTREAM): master/ as it is, master-base/
# with the open pull requests the series is stacked on (its `base`: #21666), master-patched/ with those and the pull
# requests of $(SERIES_MASTER) applied by git am (its `series` names one folder per pull request, each with its own
# `series` of .patch files). The trees are recreated on every run: do not work inside them. Each is installed
# editable in a venv of its own, without ddp_sigterm: see tools/upstream_suite.py.
# SERIES_MASTER=<folder> tests another series; a folder without a `series` file means none (patched == unpatched).
LIGHTNING_MASTER ?= $(wildcard $(call ARCHIVE,master))
# The open upstream pull requests' diffs; a series' `base` file names those it is stacked on (applied first, in
# master-base/ and master-patched/; patches/build.sh does the same for the release build).
OPEN_PRS ?= $(LIGHTNING_SOURCES)/open-prs
SERIES_MASTER ?= patches/lightning-master
UPSTREAM := build/upstream
VENV_UPSTREAM := .venv-upstream
VENV_UPSTREAM_PATCHED := .venv-upstream-patched
# master + the series' base alone (#21666, #21665): the floor of make bench-master; not needed by make test-upstream
VENV_UPSTREAM_BASE := .venv-upstream-base
# Master's tests of the code the series touches, run in each tree: whole folders where they are cheap and files where
# they are not: connectors/ (most of its time is test_data_connector's persistent-workers warning test, kept:
# DataLoader workers and signals meet) and loops/ whole; the CombinedLoader's and SIGTERMException's tests; the
# OnExceptionCheckpoint / save_on_exception tests (master has no callbacks/test_on_exception_checkpoint.py: they live
# in checkpointing/test_model_checkpoint.py, whole, and in trainer/test_trainer.py, mostly slow ddp_spawn tests: only
# its exception tests); test_ddp_sigterm_handling.py (#20825's test, which needs 2 GPUs, unpatched; PR 1's multi-process
# tests on CPU, patched). Test files the series adds or changes are run too.
UPSTREAM_TEST_FILES := tests_pytorch/trainer/connectors tests_pytorch/loops \
	tests_pytorch/utilities/test_auto_restart.py tests_pytorch/utilities/test_combined_loader.py \
	tests_pytorch/utilities/test_exceptions.py \
	tests_pytorch/models/test_hooks.py tests_pytorch/checkpointing/test_model_checkpoint.py \
	$(addprefix tests_pytorch/trainer/test_trainer.py::,test_checkpoint_path_input_last_fault_tolerant \
		test_on_exception_hook test_keyboard_interrupt test_error_handling_all_stages \
		test_trainer_calls_logger_finalize_on_exception test_trainer_calls_strategy_on_exception \
		test_trainer_calls_datamodule_on_exception) \
	tests_fabric/utilities/test_distributed.py tests_pytorch/trainer/test_ddp_sigterm_handling.py

.PHONY: test test-unit lint test-versions test-extended test-slurm test-multinode test-lightning test-upstream upstream-trees patched-lightning test-patched \
	fetch-upstream venv \
	soak bench bench-grace bench-multinode bench-master gpu-check demo clean

# Every venv that runs the suite's jobs also has its support package, tests/support (ddp_sigterm_tests), editable.
SUPPORT := -e tests/support
# Venvs are made by $(PYTHON) -m venv and filled by uv (build/uv, pinned): it downloads and compiles in parallel and
# links what its cache (~/.cache/uv) already holds, so that every venv after the first costs seconds, torch included
# (pip: 2 minutes for .venv). uv reads no pip.conf: the local wheels pip is pointed at here (PIP_FIND_LINKS, this
# machine's CPU torch for Python 3.11) are passed on.
UV := build/uv/bin/uv
UV_INSTALL = $(UV) pip install --quiet --compile-bytecode $(addprefix --find-links ,$(PIP_FIND_LINKS)) --python
$(UV):
	@test -n "$(PYTHON)" || { echo "error: no Python 3.12 here (tools/python.sh); or set PYTHON=..." >&2; exit 1; }
	rm -rf build/uv
	$(PYTHON) -m venv build/uv
	build/uv/bin/pip install $(PIP_FLAGS) uv==0.13.10

# A new venv $(1), empty.
define new_venv
	rm -rf $(1)
	$(PYTHON) -m venv $(1)
endef

# torch pinned in every install: an unpinned torch would pull a newer multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml tests/support/pyproject.toml requirements/constraints.txt \
		requirements/test.txt requirements/storage.txt requirements/loggers.txt | $(UV)
	$(call new_venv,$(VENV))
	$(UV_INSTALL) $(VENV) -c requirements/constraints.txt torch -r requirements/test.txt \
		-r requirements/storage.txt -r requirements/loggers.txt -e ".[lightning,pytorch-lightning]" $(SUPPORT)
	touch $@

$(VENV)/.lint-installed: $(VENV)/.installed requirements/lint.txt
	$(UV_INSTALL) $(VENV) -r requirements/lint.txt
	touch $@

# make test-versions' venvs, one per release but the pinned one, with both lightning and pytorch-lightning of that
# release.
.venv-lightning-%/.installed: pyproject.toml tests/support/pyproject.toml requirements/test.txt | $(UV)
	$(call new_venv,$(@D))
	$(UV_INSTALL) $(@D) -r requirements/test.txt torch==$(TORCH) lightning==$* pytorch-lightning==$*
	$(UV_INSTALL) $(@D) --no-deps -e . $(SUPPORT)
	touch $@

# Lightning $(PATCHED_RELEASE) with patches/ applied (see patches/build.sh), built into dist/ and installed alone.
$(VENV_PATCHED)/.installed: patches/build.sh $(SERIES)/series \
		$(wildcard $(SERIES)/base $(SERIES)/*.patch) requirements/constraints.txt requirements/test.txt \
		tests/support/pyproject.toml | $(UV)
	$(call new_venv,$(VENV_PATCHED))
	[ -d $(OPEN_PRS) ] || bash tools/fetch_upstream.sh $(LIGHTNING_SOURCES)  # the open PRs the series is stacked on
	OPEN_PRS=$(OPEN_PRS) bash patches/build.sh $(VENV_PATCHED)/bin/python
	# the patched wheel and the test tools only: ddp_sigterm is deliberately not installed here. Lightning's tests
	# mark the flaky ones @pytest.mark.flaky (fabric's test_distributed.py): pytest-rerunfailures.
	$(UV_INSTALL) $(VENV_PATCHED) -c requirements/constraints.txt torch -r requirements/test.txt \
		$(PATCHED_WHEEL) $(SUPPORT) pytest-rerunfailures==16.1
	touch $@

# make test-upstream's venvs: torch, then the tree editable (the unified `lightning` package: PACKAGE_NAME=lightning)
# and the test tools of requirements/upstream-test.txt. Built once: the tree's path does not change, so a
# re-applied series is what they import. $(1): the venv, $(2): the tree.
define upstream_venv
	$(call new_venv,$(1))
	PACKAGE_NAME=lightning $(UV_INSTALL) $(1) -c requirements/constraints-upstream.txt torch \
		-r requirements/upstream-test.txt -e $(CURDIR)/$(2)
	touch $(1)/.installed
endef

upstream-trees:
	@test -n "$(LIGHTNING_MASTER)" || { echo "error: Lightning's master snapshot ($(notdir $(call ARCHIVE,master)))" \
		"not found in $(LIGHTNING_SOURCES)/: make fetch-upstream builds it there, or set LIGHTNING_SOURCES=<its folder>" \
		>&2; exit 1; }
	$(PYTHON) tools/upstream_suite.py prepare --archive $(LIGHTNING_MASTER) --series $(SERIES_MASTER) \
		--open-prs $(OPEN_PRS) --into $(UPSTREAM)

$(VENV_UPSTREAM)/.installed: requirements/constraints-upstream.txt requirements/upstream-test.txt \
		$(LIGHTNING_MASTER) | upstream-trees $(UV)
	$(call upstream_venv,$(VENV_UPSTREAM),$(UPSTREAM)/master)

$(VENV_UPSTREAM_PATCHED)/.installed: requirements/constraints-upstream.txt requirements/upstream-test.txt \
		$(LIGHTNING_MASTER) | upstream-trees $(UV)
	$(call upstream_venv,$(VENV_UPSTREAM_PATCHED),$(UPSTREAM)/master-patched)

$(VENV_UPSTREAM_BASE)/.installed: requirements/constraints-upstream.txt requirements/upstream-test.txt \
		$(LIGHTNING_MASTER) | upstream-trees $(UV)
	$(call upstream_venv,$(VENV_UPSTREAM_BASE),$(UPSTREAM)/master-base)

venv: $(VENV)/.installed

# Clones Lightning's repository (network) when $(LIGHTNING_SOURCES) lacks one of its files; otherwise does nothing.
fetch-upstream:
	bash tools/fetch_upstream.sh $(LIGHTNING_SOURCES)

patched-lightning: $(VENV_PATCHED)/.installed

# The README's test command: unit tests and the multi-process scenarios on the Lightning requirements/constraints.txt
# pins (pyproject.toml's addopts leave out the targets below: the release matrix, the extended matrices and
# repetitions, SLURM).
test: $(VENV)/.installed
	$(VENV)/bin/python $(PYTEST) --durations=25

# ruff (Lightning's rule set) on everything, mypy --strict on src/.
lint: $(VENV)/.lint-installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# On every release of $(VERSIONS): the canary (every Lightning internal the package reaches is there, for both
# distributions, run by that release's Python) and the scenarios marked `versions` (rank 0 signalled at batch 2 under
# lightning.pytorch, rank 1 under pytorch_lightning, then resume; the release is asserted in each rank's outcome).
test-versions: $(VENV)/.installed $(foreach v,$(VERSIONS),$(call release_venv,$(v))/.installed)
	@test -n "$(VERSIONS)" || { echo "error: no releases in VERSIONS (none read from CHECKED in $(INTERNALS))" >&2; \
		exit 1; }
	@set -e; for release in $(foreach v,$(VERSIONS),$(v):$(call release_venv,$(v))); do \
		v=$${release%%:*}; venv=$${release#*:}; \
		echo "== Lightning $$v ($$venv)"; \
		CANARY_DISTRIBUTIONS=lightning,pytorch_lightning $$venv/bin/python -m pytest -ra -q \
			-p no:cacheprovider tests/test_internals.py; \
		SCENARIO_PYTHON=$(CURDIR)/$$venv/bin/python SCENARIO_EXPECT_LIGHTNING=$$v \
			$(VENV)/bin/python $(PYTEST) -q -m versions tests/test_scenarios.py; \
	done

# What make test leaves out to stay short: jobs repeated to catch what happens now and then (gloo's abort at
# exit), the stop signals other than SIGTERM and SIGINT, the examples' second launchers, more seeds of the
# uneven-loop test.
test-extended: $(VENV)/.installed
	$(VENV)/bin/python $(PYTEST) -m extended

test-unit: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -ra -n $(WORKERS) -m "not scenario and not slurm and not multinode and not versions and not extended"

# Lightning's tests of the signal connector, callback connector, loops and auto-restart, with the package installed:
# every test must end as it does on stock Lightning, but for the accepted differences listed in the script.
test-lightning: $(VENV)/.installed
	$(NEED_LIGHTNING_TESTS)
	$(VENV)/bin/python tools/upstream_suite.py package --archive $(LIGHTNING_TESTS) --into build $(LIGHTNING_TEST_FILES)

# Lightning master's own tests, from the unpatched and the patched tree, each with its venv: fails on a test the
# series breaks, a new test that fails, a test that disappears but with its file, a run that does not finish.
test-upstream: upstream-trees $(VENV_UPSTREAM)/.installed $(VENV_UPSTREAM_PATCHED)/.installed
	$(PYTHON) tools/upstream_suite.py trees --series $(SERIES_MASTER) --out $(UPSTREAM)/results \
		--unpatched $(UPSTREAM)/master $(VENV_UPSTREAM)/bin/python \
		--patched $(UPSTREAM)/master-patched $(VENV_UPSTREAM_PATCHED)/bin/python $(UPSTREAM_TEST_FILES)

test-patched: $(VENV)/.installed $(VENV_PATCHED)/.installed
	$(NEED_LIGHTNING_TESTS)
	$(PYTEST_PATCHED)
	OPEN_PRS=$(OPEN_PRS) bash patches/build.sh --tests $(LIGHTNING_TESTS)
	$(PYTEST_LIGHTNING_TEST)

# Real sbatch jobs on a private one-node SLURM cluster (tests/test_slurm.py, tests/support/slurm_cluster.py): installs
# slurm-wlm and munge with apt-get when missing (root), configures the cluster under build/slurm (never /etc; refuses
# to start next to a configured or running SLURM), and stops every daemon it started, by pid, whatever happened.
# With the package and with the patched Lightning. Where it cannot run, the tests are skipped with the reason;
# SLURM_REQUIRED=1 (.ci/run) makes that a failure. Prints each test's SLURM record and times (build/slurm-report.md).
SLURM_REQUIRED ?=
test-slurm: $(VENV)/.installed $(VENV_PATCHED)/.installed
	SLURM_PATCHED_PYTHON=$(CURDIR)/$(VENV_PATCHED)/bin/python SLURM_REQUIRED=$(SLURM_REQUIRED) \
		$(VENV)/bin/python -m pytest -ra --durations=0 -m slurm tests/test_slurm.py; \
		status=$$?; cat build/slurm-report.md 2>/dev/null; exit $$status

# Jobs across network namespaces on this machine, 2 nodes x 2 ranks (tests/test_multinode.py; tests/support/nodes.py
# makes the nodes): each launcher, a stop from node 2, resume; a two-node SLURM cluster's preemption and requeue; Gloo's pitfalls
# with the package, stock and the patched Lightning.
# Needs root (skipped with the reason otherwise; MULTINODE_REQUIRED=1, as .ci/run sets, makes that a failure). The
# trap removes what the ledger build/multinode/created names, if a killed run left it.
MULTINODE_REQUIRED ?=
test-multinode: $(VENV)/.installed $(VENV_PATCHED)/.installed
	trap '$(VENV)/bin/python tests/support/nodes.py cleanup' EXIT; \
	MULTINODE_PATCHED_PYTHON=$(CURDIR)/$(VENV_PATCHED)/bin/python MULTINODE_REQUIRED=$(MULTINODE_REQUIRED) \
		$(VENV)/bin/python -m pytest -ra --durations=0 -m multinode tests/test_multinode.py

# Randomized fault soak: N real jobs, each stopped by a random fault, then resumed (tools/soak.py).
# SEED=S replays a soak; RECORD=docs/reliability.md writes its summary there.
N ?= 10
soak: $(VENV)/.installed
	$(VENV)/bin/python tools/soak.py $(N) $(if $(SEED),--seed $(SEED)) $(if $(RECORD),--record $(RECORD))

# Benchmarks (not a test: they measure, they do not check). Writes docs/benchmarks.md and its plot.
$(VENV)/.bench-installed: $(VENV)/.installed requirements/bench.txt
	$(UV_INSTALL) $(VENV) -r requirements/bench.txt
	touch $@

bench: $(VENV)/.bench-installed $(VENV_PATCHED)/.installed
	$(VENV)/bin/python benchmarks/bench.py

# The grace period a stop needs against the checkpoint's size, local and on a moto S3 server (docs/kubernetes.md).
bench-grace: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/grace.py --s3

# The pull requests' cost table (PR 1's DESCRIPTION.md, docs/upstream.md): its attached benchmark.py on Lightning's
# master as it is (#20825's broadcast), on master + the series' base (no check: the floor) and with the series, at 1,
# 10 and 100 ms steps on 2 and 4 ranks, training only and validating every 10 steps, in make test-upstream's trees.
# REPS=... runs per cell (default 3).
bench-master: $(VENV)/.installed upstream-trees $(VENV_UPSTREAM)/.installed $(VENV_UPSTREAM_BASE)/.installed \
		$(VENV_UPSTREAM_PATCHED)/.installed
	$(VENV)/bin/python benchmarks/master.py $(if $(REPS),--reps $(REPS))

# The package's group set-up time and the stop latency across network-namespace nodes of 2 ranks (root; the
# node counts are benchmarks/multinode.py's --nodes).
bench-multinode: $(VENV)/.installed
	trap '$(VENV)/bin/python tests/support/nodes.py cleanup' EXIT; $(VENV)/bin/python benchmarks/multinode.py

# What one GPU can check (tools/gpu_check.py; under 5 minutes): PR 1's vote on a one-rank NCCL group under
# torch.cuda.set_sync_debug_mode("error") and Lightning's batch-end window, with the patched build; a one-process CUDA
# Trainer stopped by SIGTERM and one not, with the package and with the patched build. Both venvs need a CUDA build of
# torch (the pinned release from an index that has it); exits 2 where there is no CUDA device. What needs two GPUs:
# docs/upstream.md, "On GPUs".
gpu-check: $(VENV)/.installed $(VENV_PATCHED)/.installed
	$(VENV_PATCHED)/bin/python tools/gpu_check.py vote
	$(VENV_PATCHED)/bin/python tools/gpu_check.py window
	$(VENV)/bin/python tools/gpu_check.py trainer
	$(VENV_PATCHED)/bin/python tools/gpu_check.py trainer

demo: $(VENV)/.installed
	$(VENV)/bin/python demo/demo.py

clean:
	rm -rf $(VENV) .venv-py3.* .venv-lightning-* $(VENV_PATCHED) $(VENV_UPSTREAM) $(VENV_UPSTREAM_PATCHED) \
		$(VENV_UPSTREAM_BASE) build dist \
		src/*.egg-info .pytest_cache
