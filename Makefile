# The two commands of the README: `make demo` and `make test`. Each sets up .venv first.
VENV := .venv
STAMP := $(VENV)/.fedfit-setup-done

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fedfit sim --algorithm heterofl --agents 8 --rounds 5 --dataset fashion-mnist \
		--partition iid --seed 0

# Tests run in TEST_WORKERS processes (pytest-xdist, work stealing): much of a test's time is waiting on brokers and
# training processes, so more workers than cores still shorten the run. On 2 cores, 4 workers: 4:21 on a clean
# clone at 6eab263 (6:30 with its setup, a niced simulation beside it); 6:16 at 14e0560 (8:44 with setup) with three
# experiment comparisons training beside it, 2026-11-28; 5:15 at a0cd4ab in a working tree, nothing beside it;
# 5:57 at 6efa5ce (2938 tests), nothing beside it, 2026-11-29; 4:31 at e025a55 (3053 tests) and 3:57 at 63c689e (3057),
# nothing beside them, 2026-12-06; 4:56 at b8941d9 (3340 tests), nothing beside it, 2026-12-07; 5:21 at 9a28d85
# (the same tests), nothing beside it, 2026-12-07: over 5 minutes, the slowest tests are the next to trim.
# The ten slowest tests are listed at the end of every run (--durations), the place to look when it nears 5 minutes.
TEST_WORKERS ?= 4

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=10

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy protocol models common coordinator edge_agent fedfit loadrig

clean:
	rm -rf runs .pytest_cache
