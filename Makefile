# One-command set-up: every target creates .venv on first use and installs the package
# with its extras. torch is pinned through constraints.txt so a fresh machine takes the
# CPU build instead of a multi-GB CUDA one.
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.geomuon-installed
export PIP_CONSTRAINT = $(CURDIR)/constraints.txt

.PHONY: setup test test-slow test-thorough docs demo clean browser

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
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
# only where that needs no question (root, or CI with passwordless sudo); elsewhere the
# test skips and says what to install. A failed install does not stop `make test`: under
# CI=true the browser test then fails with the reason.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif [ "$$CI" = true ] && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	  else echo "note: chromium not found, the docs browser test will skip (install it: sudo apt-get install chromium)"; exit 0; fi; \
	  echo "installing chromium for the docs browser test (log: $(VENV)/chromium-install.log)"; \
	  mkdir -p $(VENV); \
	  { $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium; } \
	    >$(VENV)/chromium-install.log 2>&1 \
	    || echo "warning: installing chromium failed, see $(VENV)/chromium-install.log"; }

clean:
	rm -rf $(VENV) site build *.egg-info .pytest_cache .hypothesis
