# Two commands on a fresh machine: `make up` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: up test install install-test lint proto clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

# Reinstall only when the project's metadata changes.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PIP) -e '.[test]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

up: install
	$(PY) -m cli.main up

# the walls between the rooms, one formatter, the linter, the type checker, the design doc's tables
lint: install-test
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m cli.main docs --check

test: install-test lint
	$(PY) -m pytest $(PYTEST_ARGS)

proto: install-test
	PYTHON=$(PY) proto/build.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
