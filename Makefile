# grpo-flow: every target does its own set-up on a fresh machine (Python 3.11 + cargo).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMPS := .stamps
RUST_SOURCES := Cargo.toml packer_rs/Cargo.toml $(wildcard packer_rs/src/*.rs)

.PHONY: install demo demo-smoke serve lint fmt test test-rust test-python test-slow models bench-packing wheelhouse-h200 clean

# .venv with the pinned dependencies and this checkout installed editable, packer_rs built in place (what every target
# below does first; packer_rs/__init__.py names it when the extension is missing).
install: $(STAMPS)/install
	@ls packer_rs/_native*.so >/dev/null 2>&1 || { rm -f $(STAMPS)/install && $(MAKE) --no-print-directory $(STAMPS)/install; }

# The main job: the grpo-train flow on SmolLM2-135M-Instruct (Prefect's embedded API, MLflow on SQLite).
# `make demo STEPS=2` trains that many optimizer steps instead of the config's train.max_steps.
STEPS ?=
demo: $(STAMPS)/install
	$(VENV)/bin/grpo train --config configs/demo.yaml $(if $(STEPS),--set train.max_steps=$(STEPS))

# The short form of `make demo` (2 steps) that .ci/run runs on the clean checkout; it fails unless both steps train.
demo-smoke: $(STAMPS)/install
	$(MAKE) demo STEPS=2

# Prefect server + process worker on 127.0.0.1:4200 with the deployments registered; Ctrl-C stops all.
serve: $(STAMPS)/install
	$(VENV)/bin/grpo deploy

# The style checks, run first by .ci/run and by pre-commit (.pre-commit-config.yaml): ruff format and check over
# the tree, pyright (basic) on the packages [tool.pyright] lists, rustfmt and clippy (warnings are errors) on
# packer_rs. They change nothing; `make fmt` applies what can be applied (formatting, import order, unused noqa).
lint: $(STAMPS)/lint $(STAMPS)/deps
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pyright
	cargo fmt --all --check
	PYO3_PYTHON=$(abspath $(PY)) cargo clippy --all-targets --all-features -- -D warnings

fmt: $(STAMPS)/lint
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
	cargo fmt --all

# Tests in two tiers (CONTRIBUTING.md, Test tiers): `make test` is the default tier (Rust, then every Python test
# not marked slow); `make test-slow` runs the tests marked slow (full flow runs, seeded chaos, multi-node, network
# namespaces, the browser, compile, benchmark smokes). CI runs both.
# Each tier's Python tests run on TEST_WORKERS pytest-xdist workers (--dist loadgroup: the tests of one shared
# server stay on one worker, and a file's tests on one, tests/conftest.py), then those marked serial (wall-clock
# bounds, a port given up and taken again) alone in a second, short pass (a tier with none passes: pytest's exit 5,
# no test collected); TEST_WORKERS=0 runs it all in one process.
TEST_WORKERS ?= 2
test: test-rust test-python

test-rust:
	cargo test --release -p packer_rs

test-python: $(STAMPS)/install models
	$(PY) -m pytest -q -m "not slow and not serial" $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup) --durations=25
	$(PY) -m pytest -q -m "not slow and serial" --durations=10

test-slow: $(STAMPS)/install $(STAMPS)/chromium models
	$(PY) -m pytest -q -m "slow and not serial" $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup) --durations=25
	$(PY) -m pytest -q -m "slow and serial" --durations=10 || [ $$? = 5 ]

# The registry models the tests load, built once into the tests' cache (.cache, tests/conftest.py) before any test
# runs, so that no test's time or timeout includes a conversion or a random build (each is reused afterwards).
TEST_MODELS := smollm2-135m-instruct tiny-llama tiny-qwen3 tiny-qwen3.5 tiny-qwen3-moe
models: $(STAMPS)/install
	HF_HUB_OFFLINE=1 GRPO_FLOW_CACHE_DIR=$(CURDIR)/.cache $(PY) -c "import sys; \
		from grpo_core.config import ModelConfig; from grpo_core.models import resolve_model_dir; \
		[print(resolve_model_dir(ModelConfig(name=n))) for n in sys.argv[1:]]" $(TEST_MODELS)

# Debian's chromium for the browser tests of the Prefect and MLflow UIs (slow tier; as root on a fresh machine, else
# those tests skip).
$(STAMPS)/chromium:
	@mkdir -p $(STAMPS)
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || \
		echo "chromium not installed: the browser test will be skipped"
	@touch $@

bench-packing: $(STAMPS)/install
	$(PY) benchmarks/packing.py

# The manual: mkdocs + mkdocs-material (the `docs` extra of pyproject.toml) into .venv when missing, the
# configuration reference generated from the config schema, then the site in site/; any warning fails it.
.PHONY: docs
docs: $(STAMPS)/deps
	@$(PY) -c "import mkdocs, material" 2>/dev/null || $(PY) -c "import tomllib; \
		print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))" \
		| xargs $(PIP) install -q
	$(PY) scripts/gen_config_reference.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Offline GPU hosts: wheels of every dependency the H200 image lacks (CPython 3.12, manylinux x86_64, glibc 2.39)
# plus TRL (the bench extra, for benchmarks/trl_async_grpo.py) and this project's own abi3 wheel, in parts of at most 56 MiB under .gpu/wheelhouse/partN/.
# On the host: bash scripts/install_wheelhouse.sh <parts> <site folder> (pip --no-index); see docs/gpus.md.
wheelhouse-h200: $(STAMPS)/deps
	$(PY) scripts/wheelhouse.py --python-version 3.12 --glibc 2.39 --have scripts/hosts/h200-image.txt \
		--without playwright --extra bench --out .gpu/wheelhouse

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Python dependencies: re-resolved only when pyproject.toml changes.
$(STAMPS)/deps: pyproject.toml | $(PY)
	@mkdir -p $(STAMPS)
	$(PIP) install -q "maturin>=1.9,<2"
	$(PY) scripts/install_deps.py
	@touch $@

# The style tools: the lint extra of pyproject.toml (exact pins), reinstalled when pyproject.toml changes.
$(STAMPS)/lint: pyproject.toml | $(PY)
	@mkdir -p $(STAMPS)
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['lint'], sep='\n')" \
		| $(PIP) install -q -r /dev/stdin
	@touch $@

# The project itself, editable, with packer_rs built in release mode; rebuilt when Rust changes.
$(STAMPS)/install: $(STAMPS)/deps $(RUST_SOURCES)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	@touch $@

clean:
	rm -rf $(STAMPS) target packer_rs/_native*.so
