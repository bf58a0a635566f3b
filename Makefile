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

.PHONY: install demo test bench cuda-check clean

$(STAMP): $(SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip setuptools wheel ninja
	$(PIP_INSTALL) torch
	$(PIP_INSTALL) --no-build-isolation -e '.[test,bench]'
	touch $@

install: $(STAMP)

demo: install
	$(BIN)/torchrun --nproc-per-node $(NPROC) -m megatron_grpo train --config configs/grpo_tiny_cpu.yaml

test: install
	$(BIN)/python -m pytest -q tests

bench: install
	$(BIN)/python -m megatron_grpo bench logprob
	$(BIN)/python -m megatron_grpo bench scheduler

# Compile-check the CUDA kernels with plain nvcc (no torch headers needed); runs nothing.
cuda-check:
	$(NVCC) -std=c++17 -O3 -Xcompiler -Wall -Icsrc -c csrc/logprob_cuda.cu -o /tmp/megatron_grpo_logprob_cuda.o \
	  -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90

clean:
	rm -rf build *.egg-info megatron_grpo/_C*.so
