# Two entry points, each self-contained on a fresh machine: `make demo` and `make test` (`make install` only sets up).
# Each creates .venv when it is missing and installs the project with its dev, hf and examples extras (the tests
# cover Hugging Face models and run the pretraining example's command line too).
#
# TORCH_SPEC: pip's arguments for torch, installed before the project. Left empty, pip picks torch from
# pyproject.toml as for any user (on Linux the public index serves the CUDA build). On a CPU-only machine:
#     make demo TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"
# .venv remembers the last TORCH_SPEC given: a different one reinstalls torch, an empty one keeps what is there.

PYTHON ?= python3
TORCH_SPEC ?=
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sage-lightning-installed
TORCH_STAMP := $(VENV)/.torch-spec

.PHONY: install demo test lint clean FORCE

$(PY):
	$(PYTHON) -m venv $(VENV)

# Checked on every run (FORCE), rewritten only when TORCH_SPEC names another torch; the file's time then moves,
# which reinstalls the project too. --force-reinstall --no-deps swaps the torch build even when the version
# already installed satisfies the spec (a CUDA 2.13.0 for a CPU 2.13.0); the second install adds its dependencies.
$(TORCH_STAMP): FORCE | $(PY)
	@if [ -n '$(strip $(TORCH_SPEC))' ] && [ "$$(cat $@ 2>/dev/null)" != '$(strip $(TORCH_SPEC))' ]; then \
		echo "installing torch: $(strip $(TORCH_SPEC))"; \
		$(PY) -m pip install --force-reinstall --no-deps $(TORCH_SPEC) && \
		$(PY) -m pip install $(TORCH_SPEC) && \
		printf '%s\n' '$(strip $(TORCH_SPEC))' > $@; \
	elif [ ! -e $@ ]; then \
		: > $@; \
	fi

$(STAMP): pyproject.toml $(TORCH_STAMP) | $(PY)
	$(PY) -m pip install -e ".[dev,hf,examples]"
	touch $(STAMP)

install: $(STAMP)

# The pretraining example's tiny config on the CPU: a LLaMA-style model on the Python standard library's source,
# SageBwd attention steered by AdaptivePrecision; TensorBoard logs in runs/tiny.
demo: $(STAMP)
	$(PY) -m examples.pretrain fit --config examples/configs/tiny.yaml

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
