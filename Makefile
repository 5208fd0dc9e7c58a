# make run   - serve on 127.0.0.1:8000 with an embedded SQLite database under ./var/
# make demo  - serve sample orders with local stand-ins (database in ./var/demo/), print what to try
# make test  - mypy (mypy.ini), then the whole suite on SQLite, then on PostgreSQL (TEST_POSTGRES_URL)
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

test: typecheck test-sqlite test-postgres

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
