# Two commands: `make demo` and `make test`. Each builds .venv with a Python >= 3.12 found on the machine
# (scripts/find_python.sh), installs what it needs, and runs.
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2 -q

.PHONY: demo test test-gpu clean fixtures

$(PY):
	"$$(sh scripts/find_python.sh)" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m ulacache_jax.demo

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

# On a GPU machine: the same suite, GPU-marked tests included (they skip themselves without a GPU).
test-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu

# Regenerates the transformers parity fixtures in a Python 3.11 side venv (torch never enters .venv).
fixtures:
	sh tests/fixtures/make_fixtures.sh

clean:
	rm -rf $(VENV) build *.egg-info
