# Two entry points, each self-contained on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install the project with its dev and hf extras (the tests cover
# Hugging Face models too).
# TORCH_SPEC installs a particular torch first (e.g. TORCH_SPEC=torch==2.13.0 for a CPU-only build where
# the package index offers one); left empty, pip picks torch from pyproject.toml as for any user.

PYTHON ?= python3
TORCH_SPEC ?=
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sage-lightning-installed

.PHONY: demo test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(if $(TORCH_SPEC),$(PY) -m pip install "$(TORCH_SPEC)")
	$(PY) -m pip install -e ".[dev,hf]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
