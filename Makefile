# Every target builds its own virtual environment from nothing and reuses it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run

.PHONY: test test-under-load unit lint demo bench system-deps agents e2e-docker clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q -e '.[test,docker]'
	touch $(STAMP) $(RUN_STAMP)

# What running the hub and a runner needs, no test tools: `make demo`.
$(RUN_STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q -e .
	touch $(RUN_STAMP)

# Debian packages the broker, multi-host, dashboard (browser), agent CLI (npm) and alert rule (promtool, from
# prometheus) tests use. Installed only when
# running as root with apt-get; elsewhere those tests skip and say why.
# docker.io, docker-compose and debootstrap: the docker e2e (tests/harness/docker_env.py).
system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=""; \
	  command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || missing="$$missing mosquitto"; \
	  command -v ip >/dev/null || missing="$$missing iproute2"; \
	  command -v iptables >/dev/null || missing="$$missing iptables"; \
	  command -v dockerd >/dev/null || [ -x /usr/sbin/dockerd ] || missing="$$missing docker.io"; \
	  command -v docker-compose >/dev/null || missing="$$missing docker-compose"; \
	  command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ] || missing="$$missing debootstrap"; \
	  command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	  [ -x /usr/bin/chromium ] || missing="$$missing chromium"; \
	  command -v npm >/dev/null || missing="$$missing nodejs npm"; \
	  if [ -n "$$missing" ]; then \
	    echo "installing Debian packages:$$missing"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	      || echo "WARNING: apt-get install$$missing failed; those tests will skip"; \
	  fi; \
	  if ! command -v promtool >/dev/null; then \
	    echo "installing Debian packages: prometheus (for promtool; RUNLEVEL=1: its daemon is not started)"; \
	    (apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
	      || echo "WARNING: apt-get install prometheus failed; the alert rule tests will skip"; \
	  fi; \
	fi

# The real agent CLIs the agent tests run (@anthropic-ai/claude-code and @openai/codex,
# pinned in tests/agents/package-lock.json), installed from the npm registry once and kept in
# tests/agents/node_modules; they talk only to the tests' model server on 127.0.0.1.
AGENTS_STAMP := tests/agents/node_modules/.installed
agents: $(AGENTS_STAMP)
$(AGENTS_STAMP): tests/agents/package.json tests/agents/package-lock.json
	@if command -v npm >/dev/null; then \
	  cd tests/agents && npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.installed; \
	else echo "WARNING: npm is missing; the agent CLI tests will skip"; fi

# mypy and import-linter resolve `mam.*` through a tree of links: the editable
# install maps the folders with an import hook that neither runs. The layer and
# independence contracts are [tool.importlinter] in pyproject.toml.
TYPECHECK := .typecheck
lint: $(STAMP)
	@mkdir -p $(TYPECHECK)/mam
	@for pkg in shared runner orchestrator; do ln -sfn ../../$$pkg $(TYPECHECK)/mam/$$pkg; done
	@ln -sfn ../../api/__init__.py $(TYPECHECK)/mam/__init__.py
	$(VENV)/bin/ruff check .
	cd $(TYPECHECK) && ../$(VENV)/bin/mypy --config-file ../pyproject.toml -p mam
	cd $(TYPECHECK) && ../$(VENV)/bin/lint-imports --no-cache ../pyproject.toml

# Two pytest workers (pytest-xdist), each given whole files (`--dist loadfile`): the e2e
# tests mostly wait on brokers, agents and deadlines, so this halves the wall time on 2 cores.
# The workers share no port (tests/harness/brokers.py free_port splits them), namespace
# (random tags) or store (tmp_path); the docker scenarios (one file, one engine) stay on one
# worker. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: $(STAMP) system-deps agents lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

# The same suite while two CPU hogs (`yes > /dev/null`) compete for the CPUs:
# no test may depend on how fast the machine is. tests/load.sh kills them afterwards.
test-under-load: $(STAMP) system-deps agents lint
	tests/load.sh $(PY) -m pytest tests

# The multi-host e2e in docker-compose (as root): starts dockerd when none answers
# (addresses inside 100.64.0.0/10) and stops it after, builds the images offline
# (the debootstrapped base image is kept in the engine), runs the scenarios.
e2e-docker: $(STAMP) system-deps
	$(PY) -m pytest -p no:cacheprovider tests/unit/test_tailnet_policy.py tests/e2e/test_deploy_docker.py

unit: $(STAMP)
	$(PY) -m pytest tests/unit

demo: $(RUN_STAMP)
	$(PY) examples/demo.py

# bench/bench_queue.py runs Celery + Redis side by side (the `bench` extra, redis-server).
bench: $(STAMP) system-deps
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m pytest bench -p no:cacheprovider --timeout=600 -s

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis $(TYPECHECK) build/docker deploy/docker/wheelhouse
