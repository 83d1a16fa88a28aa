PYTHON ?= python3

.PHONY: install demo test lint

install:
	bash scripts/install.sh

# Main job: runs the offline engine on the embedded default model.
demo: install
	$(PYTHON) examples/quickstart.py

test: install
	$(PYTHON) -m pytest -q tests

lint:
	$(PYTHON) -m ruff check .
