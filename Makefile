# Fresh-machine entry points: `make demo` runs a batch locally, `make test` runs the tests.
# Each target sets up what it needs (virtualenv, packages, OpenBLAS on Linux) first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
UNAME := $(shell uname -s)
ifeq ($(UNAME),Linux)
  EXTRAS := cpu,test
  OPENBLAS := $(firstword $(wildcard /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0))
else
  EXTRAS := test
  OPENBLAS :=
endif
# MLX's Linux CPU wheel links the reference BLAS; OpenBLAS is ~40x faster.
RUN := $(if $(OPENBLAS),LD_PRELOAD=$(OPENBLAS) MLXQ_OPENBLAS=0,)

.PHONY: setup demo test lint clean

$(BIN)/.installed: pyproject.toml
	@if [ "$(UNAME)" = Linux ] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq libopenblas0-pthread; \
	  else echo "note: install libopenblas0-pthread (apt) for ~40x faster MLX on the CPU"; fi; fi
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	touch $@

setup: $(BIN)/.installed

models/tiny/config.json: $(BIN)/.installed
	$(RUN) $(BIN)/mlxq make-model models/tiny --preset tiny

demo: models/tiny/config.json
	$(RUN) $(BIN)/mlxq run examples/prompts.jsonl --model models/tiny -o out/results.jsonl
	@echo "--- first result:" && head -n 1 out/results.jsonl

test: $(BIN)/.installed
	$(RUN) $(BIN)/python -m pytest -q

lint: $(BIN)/.installed
	$(BIN)/ruff check mlxq tests bench && $(BIN)/ruff format --check mlxq tests bench

clean:
	rm -rf $(VENV) models out
