PYTHON ?= python3

.PHONY: install demo test lint bench

install:
	bash scripts/install.sh

# Main job: runs the offline engine on the embedded default model.
demo: install
	$(PYTHON) examples/quickstart.py

test: install
	$(PYTHON) -m pytest -q tests

# Regenerates benchmarks/results/, benchmarks/figures/ and the tables in benchmarks/README.md.
# Bigger workloads: make bench BENCH_ARGS="--scale 4".
bench: install
	$(PYTHON) benchmarks/run_all.py $(BENCH_ARGS)

lint:
	$(PYTHON) -m ruff check .
