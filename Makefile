# The two commands of the README. Each creates the environment on first use.
#   make train   train the tiny config on the embedded corpus (CPU, a few minutes)
#   make test    run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
WORKDIR ?= workdirs/tiny
# Two stamps: `make train` installs only what training needs; `make test` adds torch, transformers
# and lm-evaluation-harness (the references the tests compare against) and the GPU compilers
# (gpu_compile: the tests compile the train step for H100 and MI300X, deviceless) on top.
TRAIN_STAMP := $(VENV)/.installed-train
TEST_STAMP := $(VENV)/.installed-test

.PHONY: train test env clean

env: $(TEST_STAMP)

# uv installs (pip's resolution, in under a minute where pip takes a minute and a half), with the
# system's certificates as pip uses them; pip installs uv, and installs in its place if uv fails.
# What training imports is compiled to bytecode at install (UV_INSTALL), as pip does. The test
# extras are not (UV): ~14,000 files, of which the tests import a few thousand; `make test` writes
# the bytecode of what it imports instead.
UV := $(VENV)/bin/uv pip install -q --native-tls --python $(PY)
UV_INSTALL := $(UV) --compile-bytecode
# The CPU build of torch lies in pip's find-links folder (uv does not read pip's configuration);
# asked of pip only when torch is installed.
TORCH_WHEELS = $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)

$(TRAIN_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv
	$(UV_INSTALL) -e . || $(PY) -m pip install -q -e .
	@touch $@

# torch first, pinned to the local CPU build (else pip's `torch==2.13.0`, which takes it too);
# letting transformers (or accelerate) pull torch in would fetch the newest CUDA build instead.
$(TEST_STAMP): $(TRAIN_STAMP)
	$(UV) $(if $(TORCH_WHEELS),--find-links $(TORCH_WHEELS)) torch==2.13.0+cpu \
		|| $(PY) -m pip install -q torch==2.13.0
	$(UV) -e '.[test,interop,gpu_compile]' || $(PY) -m pip install -q -e '.[test,interop,gpu_compile]'
	@touch $@

train: $(TRAIN_STAMP)
	$(PY) -m zaya_jax.train --config configs/tiny.py --workdir $(WORKDIR) $(ARGS)

# Two pytest workers (pytest-xdist) on CI's two cores: most of a test is one XLA compile on one
# thread. Each test file stays in one worker (loadfile), where its shared compiled programs live;
# the files go out heaviest first (tests/conftest.py orders them), so no long file starts last.
# TEST_WORKERS=0: one process. The tests' ~200 Python processes write the bytecode of what they
# import (the repository's, the test extras'), so each module compiles once, not in every process,
# even where PYTHONDONTWRITEBYTECODE is set.
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(PY) -m ruff check .
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

clean:
	rm -rf $(VENV) workdirs
