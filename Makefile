# Two entry points, each self-contained on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install the project with its dev, hf and examples extras (the tests
# cover Hugging Face models and run the pretraining example's command line too).
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
	$(PY) -m pip install -e ".[dev,hf,examples]"
	touch $(STAMP)

# The pretraining example's tiny config on the CPU: a LLaMA-style model on the Python standard library's source,
# SageBwd attention steered by AdaptivePrecision; TensorBoard logs in runs/tiny.
demo: $(STAMP)
	$(PY) examples/pretrain.py fit --config examples/configs/tiny.yaml

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
