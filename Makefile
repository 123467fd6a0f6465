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

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy protocol models common coordinator edge_agent fedfit loadrig

clean:
	rm -rf runs .pytest_cache
