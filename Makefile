# The two commands of the README. Each creates the environment on first use.
#   make train   train the tiny config on the embedded corpus (CPU, a few minutes)
#   make test    run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
WORKDIR ?= workdirs/tiny
STAMP := $(VENV)/.installed

.PHONY: train test env clean

env: $(STAMP)

# torch first, pinned: `pip install torch==2.13.0` takes the local CPU wheel; letting transformers
# pull torch in would fetch the newest CUDA build instead.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

train: $(STAMP)
	$(PY) -m zaya_jax.train --config configs/tiny.py --workdir $(WORKDIR) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) workdirs
