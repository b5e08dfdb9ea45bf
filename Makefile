# Each target bootstraps .venv on first use, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=23"
	$(BIN)/python -m pip install --quiet -c constraints-dev.txt -e '.[torch,plot,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tokenspeed-router demo

lint: $(STAMP)
	$(BIN)/ruff check tokenspeed_router tests benchmarks examples
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/tokenspeed-router bench

clean:
	rm -rf $(VENV) build *.egg-info
