# embshard: every target installs what it needs first, so on a fresh machine the README's commands are the whole set-up.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NPROC  ?= 2

.PHONY: install test test-fast demo docs lint format clean

install: $(STAMP)

# CPU install: torch from the local CPU wheel, fbgemm-gpu-cpu, and torchrec without its CUDA fbgemm-gpu dependency.
$(STAMP): pyproject.toml requirements/cpu.txt requirements/torchrec.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/cpu.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements/torchrec.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, fbgemm_gpu, torchrec, embshard; print('installed: torch', torch.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__, 'torchrec', torchrec.__version__)"
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q tests

# DLRM on the Criteo sample, NPROC local CPU processes: prints the plan, a progress bar, the loss and the AUC.
demo: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/embshard train configs/dlrm_criteo.yaml --nproc $(NPROC)

# Regenerate docs/config.md from the config dataclasses' field docstrings (a test checks it is current).
docs: $(STAMP)
	$(PY) -m embshard.config.doc docs/config.md

lint: $(STAMP)
	$(PY) -m ruff check embshard tests launch bench
	$(PY) -m ruff format --check embshard tests launch bench

format: $(STAMP)
	$(PY) -m ruff check --fix embshard tests launch bench
	$(PY) -m ruff format embshard tests launch bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
