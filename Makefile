# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/dispatcher

.PHONY: venv test test-postgres test-sqlite lint check run demo bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	touch $@

test: test-postgres test-sqlite

test-postgres: venv
	DATABASE_URL=$(TEST_DATABASE_URL) $(BIN)/pytest

test-sqlite: venv
	env -u DATABASE_URL $(BIN)/pytest -m "not postgres"

check: venv
	$(BIN)/ruff check dispatcher project tests
	$(BIN)/python manage.py check
	$(BIN)/python manage.py makemigrations --check --dry-run

clean:
	rm -rf $(VENV) var/db.sqlite3* var/broker artifacts

# The browser test drives Debian's chromium headless; install it only if it is missing.
.PHONY: browser-deps
browser-deps:
	@if [ ! -x /usr/bin/chromium ]; then apt-get update && apt-get install -y chromium; fi
