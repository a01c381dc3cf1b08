# Holdpoint: `make run` starts the product on SQLite; `make test` runs the whole suite
# (on SQLite, or on the database in DATABASE_URL).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: run test browser lint fmt bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.test-installed: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

run: $(VENV)/.installed
	scripts/run.sh

test: browser $(VENV)/.test-installed
	$(PY) -m pytest $(PYTEST_ARGS)

# Browser tests drive Debian's Chromium (never a downloaded browser build). Installed when
# missing and we are root; otherwise a hint, and those tests skip (or fail under CI=true).
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "Installing Debian's chromium for the browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	else \
		echo "hint: browser tests need /usr/bin/chromium: sudo apt-get install -y chromium"; \
	fi

# ruff on the whole tree; mypy strict on the packages pyproject.toml names ([tool.mypy], its
# cache under var/mypy).
lint: $(VENV)/.test-installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt: $(VENV)/.test-installed
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

$(VENV)/.bench-installed: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $@

# SQLite always; PostgreSQL too when DATABASE_URL (or BENCH_POSTGRES_URL) names a server: the
# bench creates and drops its own holdpoint_bench_* databases there. Under 15 minutes.
bench: $(VENV)/.bench-installed
	$(PY) bench/run.py $(BENCH_ARGS)

clean:
	rm -rf var/*.sqlite3* var/cache var/staticfiles
