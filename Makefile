# Two commands are all a learner needs: `make lab` and `make test`.
# Each creates .venv on first use. TORCH picks the torch build: the default is the
# CPU wheel; on a GPU machine run e.g. `make TORCH=torch lab` for the CUDA build.
PYTHON ?= python3
TORCH  ?= torch==2.13.0
# PyPI's Linux torch is the CUDA build (several GB of NVIDIA libraries). On Linux without
# nvidia-smi, pip also looks in PyTorch's CPU index, whose 2.13.0+cpu wins (about 180 MB);
# when that index cannot be reached, pip gives up on it after the timeout and takes PyPI's.
# `make TORCH_INDEX= ...` turns it off; a GPU machine never uses it.
TORCH_INDEX ?= $(if $(filter Linux,$(shell uname -s)),$(if $(shell command -v nvidia-smi),,https://download.pytorch.org/whl/cpu))
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NOTEBOOKS := $(wildcard notebooks/*.ipynb solutions/*.ipynb)
# Each notebook is one test (the root conftest.py): executed once per run into build/executed/
# by tools/site.py's executor (reused while the notebook, picolib and torch are unchanged),
# failing on any cell's error. The prose check and `make site` read the same executed files.
# Two pytest-xdist workers, each test file whole on one, taken in the order given (xdist
# would otherwise start with the files that hold the most tests): the notebooks first, so that
# both workers run them. `make XDIST= test` runs everything in one process.
XDIST  ?= -n 2 --dist loadfile --no-loadscope-reorder
# JupyterLab serves the whole repository (lessons, exercises, docs), on this machine only,
# and opens on lesson 00 (tests/repo/test_lab.py starts exactly this).
LAB_ARGS := --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/notebooks/00_collectives.ipynb $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: lab test test-lib test-notebooks test-torch test-setup exercises bench clean executed site slides

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --timeout 10 --retries 1)
	$(PY) -m pip install -q -e ".[notebooks,dev]"
	touch $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(LAB_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) $(NOTEBOOKS) tests -p no:cacheprovider

test-lib: $(STAMP)
	$(PY) -m pytest -q tests/lib

test-notebooks: $(STAMP)
	$(PY) -m pytest -q $(XDIST) $(NOTEBOOKS)

# The torch range picolib supports, oldest and newest; CI (.ci/run) runs every lesson and solution
# on both besides `make test` on the pinned one, and the wrappers of PyTorch's private APIs
# (tests/lib/test_torch_compat.py). `make test-torch TORCH_VERSION=2.6.0` runs them
# under that release of PyPI's torch, from an environment kept outside the clone, in
# ${XDG_CACHE_HOME:-~/.cache}/picolib/ and reused while pyproject.toml's dependencies are unchanged
# (tools/torch_env.py, built by uv from its wheel cache there; the first build downloads 2-6 GB). `make test-setup TORCH_VERSION=...`
# runs lesson 00 from its setup cell in a fresh environment that has only that torch.
# TORCH_PYTHON picks the Python of the environment (e.g. python3.13). The executed notebooks of
# each version go to build/executed-torch-<version>/, never mixed with the pinned torch's.
TORCH_OLDEST  ?= 2.6.0
TORCH_NEWEST  ?= 2.15.0
TORCH_VERSION ?= $(TORCH_NEWEST)
TORCH_PYTHON  ?= $(PYTHON)

test-torch:
	env=$$($(PYTHON) tools/torch_env.py $(TORCH_VERSION) --python $(TORCH_PYTHON)) && \
	  PYTHONPATH=$(CURDIR) $$env/bin/python -m pytest -q $(XDIST) $(NOTEBOOKS) tests/lib/test_torch_compat.py \
	    --executed build/executed-torch-$(TORCH_VERSION) -p no:cacheprovider

test-setup:
	$(PYTHON) tools/test_setup.py $(TORCH_VERSION)

exercises: $(STAMP)
	$(PY) tools/make_exercises.py

# `make bench`: every benchmark (bench/*.py; bench/_report.py is their shared writer), then the
# README's tables from bench/results/*.json (`$(PY) tools/bench_tables.py` redoes only the tables).
bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"   # transformers, for bench/model.py only
	for b in bench/[!_]*.py; do $(PY) $$b || exit 1; done
	$(PY) tools/bench_tables.py

clean:
	rm -rf $(VENV) .pytest_cache

# Teaching (docs/teaching.md). `make site`: every lesson executed, as static HTML with its
# outputs and figures, an index and previous/next links, in build/site/ (open index.html).
# `make slides`: a reveal.js deck per lesson in build/slides/ (slide metadata: tools/slides.py).
# Both use the executed lessons in build/executed/ (the files `make test` writes), executed
# first by tools/site.py when missing or stale (the lesson, picolib or torch changed).
# Nothing is downloaded at build time. When a deck is shown it loads reveal.js (REVEAL_PREFIX),
# require.js and jQuery from their CDNs; to present offline, see docs/teaching.md ("Slides").
LESSONS  := $(sort $(wildcard notebooks/*.ipynb))
EXECUTED := $(LESSONS:notebooks/%.ipynb=build/executed/%.ipynb)
REVEAL_PREFIX ?= https://unpkg.com/reveal.js@4.0.2
SLIDES_FLAGS  ?=

executed: $(STAMP)
	$(PY) tools/site.py execute $(LESSONS)

site: executed
	$(PY) tools/site.py html --out build/site $(EXECUTED)

slides: executed
	$(VENV)/bin/jupyter nbconvert --to slides --output-dir build/slides \
	  --SlidesExporter.reveal_url_prefix=$(REVEAL_PREFIX) --SlidesExporter.reveal_scroll=True \
	  --TagRemovePreprocessor.enabled=True --TagRemovePreprocessor.remove_input_tags=prose \
	  $(SLIDES_FLAGS) $(EXECUTED)
