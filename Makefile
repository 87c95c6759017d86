# Omni: two commands for a fresh machine (README.md): `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: demo test venv lint serve clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[agent,dev,frameworks]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) manage.py migrate --noinput -v0
	$(PY) manage.py seed_demo --story
	$(PY) manage.py demo --host $(HOST) --port $(PORT)

test: venv
	$(PY) -m tests.run_suite $(ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(PY) manage.py makemigrations --check --dry-run

serve: venv
	$(PY) manage.py serve --host $(HOST) --port $(PORT)

clean:
	rm -rf var/ .pytest_cache .ruff_cache tests/artifacts
