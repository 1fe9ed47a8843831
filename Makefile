# One-command set-up: every target creates .venv on first use and installs the package
# with its extras. torch is pinned through constraints.txt so a fresh machine takes the
# CPU build instead of a multi-GB CUDA one.
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.geomuon-installed
export PIP_CONSTRAINT = $(CURDIR)/constraints.txt

.PHONY: setup test test-thorough docs demo clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,docs]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

test-thorough: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) site build *.egg-info .pytest_cache .hypothesis
