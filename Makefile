# Two commands are all a learner needs: `make lab` and `make test`.
# Each creates .venv on first use. TORCH picks the torch build: the default is the
# CPU wheel; on a GPU machine run e.g. `make TORCH=torch lab` for the CUDA build.
PYTHON ?= python3
TORCH  ?= torch==2.13.0
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NOTEBOOKS := $(wildcard notebooks/*.ipynb solutions/*.ipynb)
NBVAL  := --nbval-lax --nbval-current-env

.PHONY: lab test test-lib test-notebooks exercises bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[notebooks,dev]"
	touch $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/

test: $(STAMP)
	$(PY) -m pytest -q tests $(NOTEBOOKS) $(NBVAL) -p no:cacheprovider

test-lib: $(STAMP)
	$(PY) -m pytest -q tests

test-notebooks: $(STAMP)
	$(PY) -m pytest -q $(NOTEBOOKS) $(NBVAL)

exercises: $(STAMP)
	$(PY) tools/make_exercises.py

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
