# Two commands for a fresh CPU-only machine with Python 3.11, pip and gcc:
#   make demo   - set up .venv if needed, then run the 2-process ZeRO-3 demo
#   make test   - set up .venv if needed, then run the whole CPU test suite
# CI also runs make test-newest (the suite on the newest releases) and make test-floor (the floors).
# Also: make docs (build the documentation site, strict), make lint (ruff check + format check).
# With GPUs: make gpu-test (GPU integration tests) and make bench (benchmarks).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# On a CPU host pin the CPU build of torch first, so pip never pulls a multi-GB CUDA build.
# Set TORCH_SPEC= (empty) to keep whatever torch the environment has (GPU hosts).
TORCH_SPEC ?= torch==2.13.0
# Extra pip arguments, e.g. PIP_ARGS="--no-index --find-links .whl" on an offline host.
PIP_ARGS ?=
VENV_ARGS ?=
# The release set the venv is built from (pip constraints): requirements/tested.txt is the pinned set
# the README names; requirements/newest.txt the newest releases (make test-newest).
CONSTRAINTS ?= requirements/tested.txt
PIP := $(PY) -m pip install -q --disable-pip-version-check $(PIP_ARGS)

export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor
export HF_HUB_OFFLINE = 1
export TOKENIZERS_PARALLELISM = false
export PYTHONUNBUFFERED = 1

STAMP := $(VENV)/.hf_zero3-installed

.PHONY: demo test test-newest test-floor docs lint gpu-test bench install clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PIP) --upgrade pip setuptools wheel
	if [ -n "$(TORCH_SPEC)" ]; then $(PIP) "$(TORCH_SPEC)"; fi
	$(PIP) -c $(CONSTRAINTS) ninja numpy packaging psutil py-cpuinfo hjson msgpack \
		"pydantic>=2" einops tqdm
	# DeepSpeed ships an sdist: build it against the torch above, ops JIT-built when first used.
	DS_BUILD_OPS=0 $(PIP) --no-build-isolation -c $(CONSTRAINTS) deepspeed
	$(PIP) -c $(CONSTRAINTS) -e ".[test,trl,peft,docs,lint]"
	touch $@

install: $(STAMP)

# The DeepSpeed CPU comm op is built once before the ranks start (two ranks building it at once
# can leave a stale build lock behind; tests/fixtures/warm.py).
demo: $(STAMP)
	$(PY) tests/fixtures/warm.py
	$(PY) examples/demo.py

# Two pytest workers: single-process tests and waits of one test fill the cores the other leaves idle.
TESTS ?= tests/cpu
test: $(STAMP)
	$(PY) -m pytest $(TESTS) -q -n 2 --dist loadscope --no-loadscope-reorder

# The whole suite on the newest releases on PyPI (requirements/newest.txt), in a venv of its own.
test-newest:
	$(MAKE) test VENV=.venv-newest CONSTRAINTS=requirements/newest.txt

# The declared floors (requirements/floor.txt): the contract tests, the version table, and one
# Trainer, one lockstep and one TRL case.
FLOOR_TESTS := tests/cpu/test_upstream_contracts.py tests/cpu/test_families.py tests/cpu/test_versions.py \
	tests/cpu/test_family_loops.py tests/cpu/test_ring_cache.py \
	tests/cpu/test_trainer_zero3safe.py::test_evaluate_matches_single_process_reference \
	tests/cpu/test_lockstep_generation.py::test_tokens_match_unsharded_reference \
	tests/cpu/test_trl.py::test_grpo_default_reuses_trl_gather
test-floor:
	$(MAKE) test VENV=.venv-floor CONSTRAINTS=requirements/floor.txt TESTS="$(FLOOR_TESTS)"

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# GPU hosts: reuse the system's CUDA torch (no pin), then run the tests marked gpu.
gpu-test:
	$(MAKE) install VENV=.venv-gpu VENV_ARGS=--system-site-packages TORCH_SPEC=
	.venv-gpu/bin/python -m pytest tests/gpu -q -m gpu

bench:
	$(MAKE) install VENV=.venv-gpu VENV_ARGS=--system-site-packages TORCH_SPEC=
	.venv-gpu/bin/python benchmarks/run_all.py $(BENCH)

clean:
	rm -rf $(VENV) .venv-gpu .venv-newest .venv-floor .cache site
