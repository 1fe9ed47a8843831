# One-command set-up: every target creates .venv on first use and installs the package
# with its extras. torch is pinned (constraints.txt, torch==2.13.0) and comes from pip's
# configured sources: a machine with a local CPU wheel on pip's find-links (as CI's) takes
# it; from PyPI alone, Linux gets the multi-GB CUDA build. TORCH_INDEX=URL installs torch
# from that index first (PyTorch's CPU-only index: see the README).
VENV   ?= .venv
TORCH_INDEX ?=
PYTHON ?= python3
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.geomuon-installed
export PIP_CONSTRAINT = $(CURDIR)/constraints.txt

.PHONY: setup test test-slow test-thorough docs demo clean browser

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_INDEX),$(PY) -m pip install -q torch --index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[test,docs]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP) browser
	$(PY) -m pytest

# GPT-2 small (124M) one step per strategy: ~1 min per strategy on 2 cores.
test-slow: $(STAMP)
	$(PY) -m pytest -m slow

test-thorough: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	@echo "site built: open site/index.html in a browser (it needs no network)"

# The five seed-000 strategies on the embedded corpus (Python's own docs): CPU, offline;
# shows a progress bar per run and overall, then prints the results table, the paths of
# the figures and a summary line; each demo writes a fresh runs/demo-<UTC time>/ (runs
# and *.png), so an earlier demo is never overwritten. One thread: the demo's matrices
# are so small that a second thread costs more than it saves.
DEMO_STEPS ?= 500
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/geomuon compare --config demo --data embedded --device cpu \
	  --strategies unconstrained,all_stiefel,all_dgram,hetero,hetero_inv --seeds 0 \
	  --steps $(DEMO_STEPS) --batch-size 16 --warmup-steps 20 --eval-every 50 --adamw-lr 3e-3 \
	  --out-dir 'runs/demo-{time}'

# Headless Chromium for the docs' browser test (tests/test_docs.py). Installed with apt-get
# only under CI=true (as root, or with passwordless sudo): a developer's `make test` never
# installs system packages; there the test skips and says what to run. A failed install
# does not stop `make test`: under CI=true the browser test then fails with the reason.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$CI" != true ]; then echo "note: chromium not found, the docs browser test will skip (to run it: sudo apt-get install chromium)"; exit 0; fi; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	  else echo "warning: CI=true but no root or passwordless sudo to install chromium"; exit 0; fi; \
	  echo "installing chromium for the docs browser test (log: $(VENV)/chromium-install.log)"; \
	  mkdir -p $(VENV); \
	  { $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium; } \
	    >$(VENV)/chromium-install.log 2>&1 \
	    || echo "warning: installing chromium failed, see $(VENV)/chromium-install.log"; }

clean:
	rm -rf $(VENV) site build *.egg-info .pytest_cache .hypothesis
