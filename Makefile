# Every target creates .venv itself: two commands on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TESTS ?= tests
# Test processes: each starts its own PostgreSQL and brokers; a file's tests stay together.
TEST_WORKERS ?= 3

.PHONY: venv test test-unit test-kafka kafka-jars demo bench soak lint typecheck clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]' -c constraints.txt
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25 $(TESTS) $(PYTEST_ARGS)

# Apache Kafka's jars (tests/kafka/pom.xml) into .kafka/jars; tests also do this on first use.
kafka-jars:
	rm -rf .kafka/jars
	mvn -q -B -f tests/kafka/pom.xml dependency:copy-dependencies -DoutputDirectory=$(CURDIR)/.kafka/jars
	sha256sum tests/kafka/pom.xml | cut -d' ' -f1 > .kafka/jars/.resolved

# Only the tests on Apache Kafka (the `kafka` half of `broker`, and the Kafka-only tests).
test-kafka: $(STAMP) kafka-jars
	$(PY) -m pytest tests -k "kafka" $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# PostgreSQL refuses to run as root and the product never creates users nor changes file
# modes: run as root (CI), tests/fixtures/pg_user.py prepares an unprivileged user for the
# embedded PostgreSQL and prints its name (it prints nothing for an ordinary user).
PG_USER_ENV = OUTBOX_EMBEDDED_PG_USER="$$($(PY) -m tests.fixtures.pg_user)"

demo: $(STAMP)
	$(PG_USER_ENV) $(VENV)/bin/outbox-relay demo $(DEMO_ARGS)

bench: $(STAMP)
	$(PG_USER_ENV) $(VENV)/bin/outbox-relay bench $(BENCH_ARGS)

soak: $(STAMP)
	$(PY) -m tests.soak $(SOAK_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info
