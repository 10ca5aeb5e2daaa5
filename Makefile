# embshard: every target installs what it needs first, so on a fresh machine the README's commands are the whole set-up.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NPROC  ?= 2
# pytest-xdist workers: one more than the 2 cores the suite is sized for. Its tests wait on the processes they start
# (interpreters importing torch, rendezvous, launchers), and a third worker keeps both cores busy meanwhile
# (tests/README.md: 257 -> 199 s, 4 workers 205 s; a fresh clone's suite now 118-145 s, 176-209 s in slow hours).
TEST_WORKERS ?= 3

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

# The whole CPU suite, spread over TEST_WORKERS pytest-xdist workers (tests/conftest.py: a module's shared set-up on
# one worker, longest first). Its time on 2 cores: tests/README.md.
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

# Under 1 minute on 2 cores (2026-12-07: 49 s on 3 workers with no other jobs; 41 s, 75 s of CPU, on 2 workers at load 1-2; 93 s before the sharding
# types' small-kernel runs left Triton's interpreter). The core parity paths against
# the unsharded reference: every sharding type alone and mixed at 1-4 ranks with every optimizer, table-wise output
# groups, data-parallel (tests/sharding), the tiers' lookup options, raw ids, the sharded softmax, the fuzzer's
# covering cases and collective scenarios, the exchanges, checkpoints loaded under other world sizes and plans, and
# the small-table kernels' torch path.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests/sharding tests/lookup tests/retrieval tests/rawids/test_raw_parity.py tests/test_fuzz.py \
		tests/test_comm.py tests/checkpoint/test_checkpoint.py tests/kernels/test_kernels_small_tables.py \
		tests/kernels/test_kernels_data_parallel.py

# DLRM on the Criteo sample, NPROC local CPU processes: prints the plan, a progress bar, the loss and the AUC.
# Each run starts again: checkpoint.overwrite=true replaces the previous demo's checkpoints (runs/dlrm_criteo/).
demo: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/embshard train configs/dlrm_criteo.yaml --nproc $(NPROC) \
		checkpoint.overwrite=true

# Regenerate docs/config.md from the config dataclasses' field docstrings, bench/README.md's suites table from the
# suites' registry and docs/benchmarks.md's results from bench/results/ (tests check all three are current).
docs: $(STAMP)
	$(PY) -m embshard.config.doc docs/config.md
	$(PY) -m bench.suites --update bench/README.md
	$(PY) -m bench.report --update docs/benchmarks.md

lint: $(STAMP)
	$(PY) -m ruff check embshard tests launch bench
	$(PY) -m ruff format --check embshard tests launch bench

format: $(STAMP)
	$(PY) -m ruff check --fix embshard tests launch bench
	$(PY) -m ruff format embshard tests launch bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
