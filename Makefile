# `make demo` and `make test` work from a fresh clone: they create .venv and install what they need.
# On a CUDA machine, pass CONSTRAINTS= to keep the torch you have instead of the pinned CPU wheel.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints-cpu.txt
NPROC ?= 2
BIN := $(VENV)/bin
PIP_INSTALL := $(BIN)/pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
STAMP := $(VENV)/.installed
SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/*.cu) $(CONSTRAINTS)
NVCC ?= nvcc
# Where nvcc exists, the SASS check (tests/ops/test_cuda_static.py) disassembles the kernels with these two tools,
# which not every CUDA toolkit install ships: their PyPI wheels are small and run without a GPU.
CUDA_TOOLS := nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37

# megatron-core 0.17+ declares Python >= 3.12 and imports triton undeclared; its code runs on 3.11, so the tests of
# the code that imports megatron.core run against it too, from a private target directory (the .venv keeps 0.16.x).
# Only megatron_grpo/megatron/ imports megatron.core (tests/test_layering.py), so this second pass runs its tests
# (tests/megatron/: the hooks, schedules, DDP, the optimizer, the fused paths, checkpoints, Megatron's notices, the
# examples), the runner's distributed checkpoint, and of the end-to-end jobs the layouts (DDP, the pipeline schedule,
# the checkpoint of any layout), the two example scripts and the README's script. The runner's other tests reach
# Megatron only through that package.
MCORE_NEW ?= 0.19.2
TRITON ?= 3.9.0
MCORE_NEW_DIR := build/megatron-core-$(MCORE_NEW)
MEGATRON_TESTS := tests/megatron tests/runner/test_grpo_checkpoint.py
MCORE_NEW_SLOW := tests/runner/test_grpo_layouts.py tests/megatron/test_example_training_loop.py tests/test_readme_python.py

.PHONY: install demo demo-figure lint test test-fast test-avx2 test-mcore-new bench bench-linear bench-packing bench-step cuda-check cuda-check-bindings gpu-wheels clean

$(STAMP): $(SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip setuptools wheel ninja
	$(PIP_INSTALL) torch
	$(PIP_INSTALL) --no-build-isolation -e '.[test,bench]'
	if command -v $(NVCC) >/dev/null 2>&1; then $(PIP_INSTALL) $(CUDA_TOOLS); fi
	touch $@

install: $(STAMP)

# A second `make demo` resumes the run in runs/grpo_tiny_cpu; `make demo TRAIN_ARGS=--fresh` starts over.
TRAIN_ARGS ?=

demo: install
	$(BIN)/megatron-grpo --nproc-per-node $(NPROC) train --config configs/grpo_tiny_cpu.yaml $(TRAIN_ARGS)

# docs/demo_on_and_off_policy.png, from the runs of the demo and its two off-policy configs (docs/runner.md).
demo-figure: install
	$(BIN)/megatron-grpo report runs/grpo_tiny_cpu runs/grpo_tiny_cpu_stale runs/grpo_tiny_cpu_ppo \
	  --out docs/demo_on_and_off_policy.png

# The tests run in $(NPROC) pytest-xdist workers, a test file to a worker (its module fixtures then run once). Many
# tests wait on rank processes they start, so two workers keep two cores busier than one; PYTEST_WORKERS=0 runs the
# suite in one process.
PYTEST_WORKERS ?= $(NPROC)
PYTEST := $(BIN)/python -m pytest -q $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

# ruff: pycodestyle, pyflakes, import order and bugbear at 120 columns (pyproject.toml's [tool.ruff]).
lint: install
	$(BIN)/ruff check .

test: install lint
	$(PYTEST) tests

# The edit loop: everything but the end-to-end multi-process runs (marked `slow`).
test-fast: install lint
	$(PYTEST) -m "not slow" tests

# The suite with torch's CPU kernels and ours capped at AVX2, as an AVX2-only machine runs it (on an AVX2 machine, the
# same as `make test`). Each kernel build is also checked against the float64 anchor within `make test` itself.
test-avx2: install
	ATEN_CPU_CAPABILITY=avx2 $(PYTEST) tests

test-mcore-new: install
	test -d $(MCORE_NEW_DIR)/megatron || $(BIN)/pip install -q --ignore-requires-python --no-deps \
	  --target $(MCORE_NEW_DIR) megatron-core==$(MCORE_NEW) triton==$(TRITON)
	PYTHONPATH=$(MCORE_NEW_DIR) $(PYTEST) -m "not slow" $(MEGATRON_TESTS)
	PYTHONPATH=$(MCORE_NEW_DIR) $(PYTEST) -m slow $(MCORE_NEW_SLOW)

# The benchmarks write under runs/bench unless told otherwise; these targets refresh the committed results.
RESULTS := benchmarks/results

bench: install
	$(BIN)/megatron-grpo bench logprob --out $(RESULTS)
	$(BIN)/megatron-grpo --nproc-per-node $(NPROC) bench scheduler --config configs/grpo_tiny_cpu.yaml --out $(RESULTS)

# The fused linear + logprob op against its peers (TP 1 and 2, fp32 and bf16, 100% and 25% response rows).
# Cut-Cross-Entropy and Liger-Kernel, when installed outside the venv with `pip install --no-deps --target DIR`,
# are found through PEER_PATH (directories, space-separated); a peer that is missing or cannot run is skipped.
PEER_PATH ?=
bench-linear: install
	$(BIN)/megatron-grpo bench linear --out $(RESULTS) $(foreach dir,$(PEER_PATH),--peer-path $(dir))

# Padded against packed microbatches on the ragged task, in one run of two interleaved variants (docs/benchmarks.md).
bench-packing: install
	$(BIN)/megatron-grpo --nproc-per-node $(NPROC) bench packing --config configs/grpo_tiny_cpu_ragged.yaml --out $(RESULTS)

# The whole GRPO train step in four configurations, each adding one feature, in one process (docs/benchmarks.md).
bench-step: install
	$(BIN)/megatron-grpo --nproc-per-node 1 bench step --out $(RESULTS)

# Compile-check the CUDA kernels with plain nvcc (no torch headers needed); runs nothing. The PTX, the cubins and
# ptxas's report (registers, spills) stay in $(CUDA_CHECK_DIR), where tests/ops/test_cuda_static.py reads them.
CUDA_SOURCES := csrc/logprob_cuda.cu csrc/top_p_cuda.cu
CUDA_CHECK_DIR := build/cuda-check
cuda-check:
	mkdir -p $(CUDA_CHECK_DIR)
	for source in $(CUDA_SOURCES); do \
	  name=$$(basename $$source .cu); \
	  $(NVCC) -std=c++17 -O3 -Xcompiler -Wall -Icsrc -c $$source -o $(CUDA_CHECK_DIR)/$$name.o \
	    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -Xptxas -v \
	    --keep --keep-dir $(CUDA_CHECK_DIR) > $(CUDA_CHECK_DIR)/$$name.ptxas.txt 2>&1 \
	    || { cat $(CUDA_CHECK_DIR)/$$name.ptxas.txt; exit 1; }; \
	done

# Compile-check (syntax and types, no code) the CUDA half of the torch bindings, csrc/bindings.cpp under
# MEGATRON_GRPO_WITH_CUDA, against the installed torch's headers and nvcc's CUDA headers. The CPU torch wheel lacks the
# one header its CUDA build generates (c10/cuda/impl/cuda_cmake_macros.h, a DLL-export macro): a stub of it stands in.
# nvcc names its own include directory in a dry run.
CUDA_INCLUDES = $(shell $(NVCC) --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^\#\$$ INCLUDES="\(.*\)" *$$/\1/p')
cuda-check-bindings: install
	mkdir -p $(CUDA_CHECK_DIR)/stub/c10/cuda/impl
	printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > $(CUDA_CHECK_DIR)/stub/c10/cuda/impl/cuda_cmake_macros.h
	torch_include=$$($(BIN)/python -c "from torch.utils import cpp_extension; print(' '.join('-I' + p for p in cpp_extension.include_paths()))"); \
	python_include=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['include'])"); \
	$(CXX) -std=c++17 -fsyntax-only -w -DMEGATRON_GRPO_WITH_CUDA -Icsrc -I$(CUDA_CHECK_DIR)/stub $$torch_include \
	  $(CUDA_INCLUDES) -I$$python_include csrc/bindings.cpp

# megatron-core for a GPU machine without it and without network (benchmarks/gpu_check.sh's `wheels` step): its wheel
# for that machine's Python, downloaded here into the git-ignored .whl/, to ship with the checkout. The cp312 wheel is
# tagged manylinux_2_28 (manylinux2014 alone finds none).
GPU_PYTHON_VERSION ?= 3.12
GPU_MCORE ?= 0.16.1
gpu-wheels: install
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl megatron-core==$(GPU_MCORE)

clean:
	rm -rf build *.egg-info megatron_grpo/_C*.so
