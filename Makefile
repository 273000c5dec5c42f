# grpo-flow: every target does its own set-up on a fresh machine (Python 3.11 + cargo).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMPS := .stamps
RUST_SOURCES := Cargo.toml packer_rs/Cargo.toml $(wildcard packer_rs/src/*.rs)

.PHONY: demo test test-rust test-python bench-packing clean

demo: $(STAMPS)/install
	@echo "make demo: the Prefect main job does not exist yet; running the packing benchmark (benchmarks/packing.py)."
	$(PY) benchmarks/packing.py

test: test-rust test-python

test-rust:
	cargo test --release -p packer_rs

test-python: $(STAMPS)/install
	$(PY) -m pytest -q

bench-packing: $(STAMPS)/install
	$(PY) benchmarks/packing.py

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Python dependencies: re-resolved only when pyproject.toml changes.
$(STAMPS)/deps: pyproject.toml | $(PY)
	@mkdir -p $(STAMPS)
	$(PIP) install -q "maturin>=1.9,<2"
	$(PY) scripts/install_deps.py
	@touch $@

# The project itself, editable, with packer_rs built in release mode; rebuilt when Rust changes.
$(STAMPS)/install: $(STAMPS)/deps $(RUST_SOURCES)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	@touch $@

clean:
	rm -rf $(STAMPS) target packer_rs/_native*.so
