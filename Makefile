# torchtosa — every target bootstraps what it needs: a .venv with torch 2.13.0 (CPU),
# the MLIR Python bindings, this package (editable) and the generated op registry.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
GEN    := runtime/_generated/registry.py
SPECS  := $(wildcard opdefs/*.yaml) $(wildcard generator/*.py generator/*.lark generator/templates/*.j2) runtime/rules.py

.PHONY: all setup gen demo test lint bench coverage corpus fuzz clean

all: test

# torch first: any other torch requirement would pull GBs of CUDA wheels.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	mkdir -p runtime/_generated
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(STAMP)

$(GEN): $(STAMP) $(SPECS)
	$(PY) -m generator

gen: $(STAMP)
	$(PY) -m generator

demo: $(GEN)
	$(PY) scripts/demo.py

lint: $(GEN)
	$(PY) -m ruff check generator runtime tests scripts
	$(PY) -m generator --check

test: lint
	$(PY) -m pytest -q -n auto -p no:cacheprovider tests

bench: $(GEN)
	$(PY) scripts/bench.py

coverage: $(GEN)
	$(PY) scripts/coverage.py

corpus: $(GEN)
	$(PY) scripts/corpus.py

fuzz: $(GEN)
	TORCHTOSA_FUZZ_EXAMPLES=2000 $(PY) -m pytest -q -n auto -p no:cacheprovider tests/test_fuzz.py tests/test_properties.py

clean:
	rm -rf $(VENV) runtime/_generated build *.egg-info
