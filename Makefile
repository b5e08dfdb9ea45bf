# Each target bootstraps .venv on first use, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch's CPU build (a plain `pip install torch` resolves to the CUDA build on
# Linux: ~19 nvidia wheels, several GB). See docs/install.md.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu

.PHONY: install demo test lint bench clean fuzz-smoke fuzz peers

# setup.py builds the compiled index core (csrc/, machine's C compiler): editing it reinstalls.
$(STAMP): pyproject.toml constraints-dev.txt setup.py $(wildcard csrc/*.c csrc/*.h)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=23"
	@# A local wheel first (pip find-links, offline mirrors), else PyTorch's CPU index.
	$(BIN)/python -m pip install --quiet --no-index --no-deps "torch==$(TORCH_VERSION)" 2>/dev/null \
	  || $(BIN)/python -m pip install --quiet "torch==$(TORCH_VERSION)" --index-url "$(TORCH_INDEX_URL)"
	$(BIN)/python -m pip install --quiet -c constraints-dev.txt -e '.[torch,plot,dev]'
	@# xds-protos (the epp extra's Envoy protos) ships old copies of the OpenTelemetry and googleapis
	@# protos over those packages' own files: put theirs back (docs/install.md, "The epp extra")
	$(BIN)/python -m pip install --quiet --force-reinstall --no-deps $$($(BIN)/python -c "import importlib.metadata as m; \
	  print(' '.join(f'{n}=={m.version(n)}' for n in ('opentelemetry-proto', 'googleapis-common-protos')))")
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tokenspeed-router demo

lint: $(STAMP)
	$(BIN)/ruff check tokenspeed_router tests benchmarks examples fuzz
	$(BIN)/mypy
	$(BIN)/mypy fuzz/run.py fuzz/fuzz_targets.py

# Two workers, a test file each at a time (--dist loadfile: a file's module fixtures are built once);
# then the few tests marked `serial` (wall-clock figures, many engines at once) alone.
PYTEST_WORKERS ?= 2
test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile -m "not serial"
	$(BIN)/python -m pytest -q -p no:cacheprovider -m serial

# Fuzzing the native decoders (docs/development.md): build/fuzz/, nothing downloaded.
# fuzz-smoke: every target a few seconds (what CI runs through tests/unit/test_fuzz_smoke.py);
# fuzz: a campaign of FUZZ_SECONDS per target, one target at a time, at low priority.
FUZZ_SECONDS ?= 1800
FUZZ_TARGETS ?= ingest msgpack convert
fuzz-smoke: $(STAMP)
	$(BIN)/python fuzz/run.py smoke

fuzz: $(STAMP)
	for t in $(FUZZ_TARGETS); do nice -n 10 $(BIN)/python fuzz/run.py campaign $$t --seconds $(FUZZ_SECONDS) || exit 1; done

bench: $(STAMP)
	$(BIN)/tokenspeed-router bench

# The real peer routers for benchmarks/compare_routers.py and benchmarks/peer_parity.py, pinned,
# in a venv of their own: never the project's (they are not dependencies; docs/compare-routers.md).
PEERS_VENV ?= .venv-peers
VLLM_ROUTER_VERSION ?= 0.1.17
SGLANG_ROUTER_VERSION ?= 0.3.2
$(PEERS_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet \
	  "vllm-router==$(VLLM_ROUTER_VERSION)" "sglang-router==$(SGLANG_ROUTER_VERSION)"
	touch $@

peers: $(PEERS_VENV)/.installed

clean:
	rm -rf $(VENV) build *.egg-info tokenspeed_router/*.so
