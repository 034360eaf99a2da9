# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/dispatcher

.PHONY: venv test test-postgres test-prepared test-sqlite lint check run demo bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	touch $@

test: test-postgres test-prepared test-sqlite

test-postgres: venv
	DATABASE_URL=$(TEST_DATABASE_URL) $(BIN)/pytest -m "not embedded"

# The in-process tests again on connections that prepare every statement at once, as a site
# that sets prepare_threshold does (dispatcher/store/prepared.py).
test-prepared: venv
	DATABASE_URL="$(TEST_DATABASE_URL)?prepare_threshold=0" $(BIN)/pytest -m "not embedded" tests/integration

test-sqlite: venv
	env -u DATABASE_URL $(BIN)/pytest -m "not postgres"

check: venv
	$(BIN)/ruff check dispatcher project tests bench demo support
	$(BIN)/mypy
	$(BIN)/python manage.py check
	$(BIN)/python manage.py makemigrations --check --dry-run

clean:
	rm -rf $(VENV) $(VENV6) var/db.sqlite3* var/broker artifacts

# The browser test drives Debian's chromium headless; install it only if it is missing.
.PHONY: browser-deps
browser-deps:
	@if [ ! -x /usr/bin/chromium ]; then apt-get update && apt-get install -y chromium; fi

# The pacing benchmark (bench/pacing.py) puts Debian's nginx (`limit_req`) in front of its fake
# API; install it only if it is missing.
.PHONY: bench-deps
bench-deps:
	@if [ ! -x /usr/sbin/nginx ]; then apt-get update && apt-get install -y --no-install-recommends nginx; fi

# Benchmarks against PostgreSQL, Redis and RabbitMQ (see docs/performance.md): `make bench` is
# the full run whose table goes to docs/performance.md; `make bench-quick` is the CI size.
BENCH_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/bench_dispatcher
BENCH_REDIS_URL ?= redis://127.0.0.1:6379/12

.PHONY: bench-quick

bench: venv
	BENCH_DATABASE_URL=$(BENCH_DATABASE_URL) BENCH_REDIS_URL=$(BENCH_REDIS_URL) $(BIN)/python -m bench --full

bench-quick: venv
	BENCH_DATABASE_URL=$(BENCH_DATABASE_URL) BENCH_REDIS_URL=$(BENCH_REDIS_URL) $(BIN)/python -m bench --quick

# The worker rows again from a new virtualenv that installed the package's wheel, as a site does:
# bench, project and support are copied to var/bench-installed, where no dispatcher/ shadows the
# installed one (the run prints where dispatcher was imported from).
BENCH_INSTALLED ?= http_threads completed worker_cpu
.PHONY: bench-installed
bench-installed: venv
	rm -rf var/bench-installed
	mkdir -p var/bench-installed/dist
	$(BIN)/pip wheel --quiet --no-deps --wheel-dir var/bench-installed/dist .
	$(PYTHON) -m venv var/bench-installed/venv
	var/bench-installed/venv/bin/pip install --quiet -r requirements.txt var/bench-installed/dist/*.whl
	cp -r bench project support manage.py var/bench-installed/
	cd var/bench-installed && BENCH_DATABASE_URL=$(BENCH_DATABASE_URL) BENCH_REDIS_URL=$(BENCH_REDIS_URL) \
		venv/bin/python -m bench --full --only $(BENCH_INSTALLED)

# The demo on the embedded default, in a folder of its own (see demo/run_demo.py).
demo: venv
	$(BIN)/python -m demo.run_demo

# Web (gunicorn, http://127.0.0.1:$(PORT)/admin/), worker, beat and dispenser together; Ctrl-C stops all.
PORT ?= 8000
run: venv
	PORT=$(PORT) $(BIN)/python -m demo.run_stack

# The Django 6.x leg of the support matrix (README, Supported versions): a second virtualenv on a
# Python >= 3.12 with Django 6.1 over the dev requirements, running the SQLite suite (the Tasks
# backend tests and the wheel-into-a-new-site test included). Skipped, saying so, without such a Python.
VENV6 := .venv-django6
BIN6 := $(VENV6)/bin

.PHONY: venv-django6 test-django6

venv-django6:
	@py=$$(.ci/find-python312); \
	if [ -z "$$py" ]; then echo "SKIPPED the Django 6.x leg: no Python >= 3.12 found (python3.12/3.13 on PATH or in pyenv)"; exit 0; fi; \
	if [ "$$(cat $(VENV6)/.installed 2>/dev/null)" != "$$py" ] || [ requirements.txt -nt $(VENV6)/.installed ] || [ requirements-dev.txt -nt $(VENV6)/.installed ] || [ requirements-django6.txt -nt $(VENV6)/.installed ]; then \
		echo "Django 6.x leg on $$($$py --version)"; \
		rm -rf $(VENV6) && $$py -m venv $(VENV6) && \
		$(BIN6)/pip install --quiet --upgrade pip && \
		$(BIN6)/pip install --quiet -r requirements-dev.txt && \
		echo "Django 6.1 over django-celery-beat's Django<6.1 cap: pip reports the conflict, on purpose (requirements-django6.txt)" && \
		$(BIN6)/pip install --quiet -r requirements-django6.txt && \
		echo "$$py" > $(VENV6)/.installed; \
	fi

test-django6: venv-django6
	@if [ -z "$$(.ci/find-python312)" ] || [ ! -f $(VENV6)/.installed ]; then exit 0; fi; \
	$(BIN6)/python -c "import django; print('Django', django.get_version())"; \
	env -u DATABASE_URL $(BIN6)/pytest -m "not postgres"
