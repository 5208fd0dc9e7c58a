# make run   - serve on 127.0.0.1:8000 with an embedded SQLite database under ./var/
# make demo  - serve sample orders with local stand-ins (database in ./var/demo/), print what to try
# make test  - mypy (mypy.ini), then the whole suite on SQLite and on PostgreSQL (TEST_POSTGRES_URL) side by side
# make bench - the receivers against a bare Tornado app, results in bench/results/
# make profile - where each receiver's time goes under load (py-spy), in bench/results/profile/
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TEST_POSTGRES_URL ?= postgresql://postgres@127.0.0.1:5432/test
PYTEST_ARGS ?=

.PHONY: run demo migrate test typecheck test-sqlite test-postgres bench profile clean

$(BIN)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	touch $@

run: $(BIN)/.installed
	$(BIN)/python receiver.py serve

demo: $(BIN)/.installed
	$(BIN)/python receiver.py demo

migrate: $(BIN)/.installed
	$(BIN)/python receiver.py migrate

# The two halves run side by side: each spends most of its time waiting on the services,
# peers and databases it starts, so together they take about as long as the longer one
# alone (2026-11-25: 9 min 55 s, against 6 min 3 s and 9 min 27 s one after the other).
# Each half's output is printed whole when it ends.
test: typecheck
	$(MAKE) --no-print-directory -j2 --output-sync=target test-sqlite test-postgres

typecheck: $(BIN)/.installed
	$(BIN)/mypy

test-sqlite: $(BIN)/.installed
	TEST_DATABASE_URL= $(BIN)/pytest $(PYTEST_ARGS)

# Not echoed: the URL may carry a password (.ci/run's role has one).
test-postgres: $(BIN)/.installed
	@echo "TEST_DATABASE_URL=<TEST_POSTGRES_URL> $(BIN)/pytest $(PYTEST_ARGS)"
	@TEST_DATABASE_URL=$(TEST_POSTGRES_URL) $(BIN)/pytest $(PYTEST_ARGS)

bench: $(BIN)/.installed
	$(BIN)/python -m bench.run $(BENCH_ARGS)

profile: $(BIN)/.installed
	$(BIN)/python -m bench.profile $(BENCH_ARGS)

clean:
	rm -rf $(VENV) var
