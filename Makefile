# kvplug build. `make` builds build/libkvplug.so; `make test` runs every CPU
# test; `make demo` builds and runs the synthetic serving trace.
# `make KERNELS=off ...` builds without the CUDA kernels (kernels/kernels.mk).
GO        ?= go
PYTHON    ?= python3
BUILD     := build
LIB       := $(BUILD)/libkvplug.so
VENV      := $(BUILD)/venv
VPY       := $(VENV)/bin/python
GO_SRC    := $(shell find capi core internal kernels -name '*.go' -not -name '*_test.go' 2>/dev/null) $(wildcard capi/*.c capi/*.h) include/kvplug.h go.mod go.sum

-include kernels/kernels.mk

# cgo does not track the headers capi includes from outside its directory
# (include/kvplug.h), so Go's build cache would reuse objects compiled against
# an older header; the header's digest in CGO_CFLAGS keys them to its content.
CGO_CFLAGS ?= -O2 -g
export CGO_CFLAGS += -DKVPLUG_HEADER_SUM=$(shell cat include/kvplug.h | cksum | cut -d' ' -f1)

.PHONY: demo-routing all lib kernels test test-go test-cpp test-python test-fresh-clone check-header check-exports demo bench clean fmt vet test-engines FORCE

all: lib

lib: $(LIB)

# Rebuild the library when KERNELS changes between runs.
$(BUILD)/kernels.setting: FORCE
	@mkdir -p $(BUILD)
	@echo $(KERNELS) | cmp -s - $@ || echo $(KERNELS) > $@

$(LIB): $(GO_SRC) $(KERNELS_DEP) $(BUILD)/kernels.setting
	@mkdir -p $(BUILD)
	$(GO) build -trimpath $(GO_TAGS) -buildmode=c-shared -o $@ ./capi
	@rm -f $(BUILD)/libkvplug.h

# A Python environment for the tests, the demo and the benchmarks. kvplug.hf's tests
# (tests/python/test_hf_*.py) need torch and transformers, and fail, not skip, without them.
# PyPI's Linux torch is the CUDA build: its nvidia-* wheels make it ~3 GB to download and
# 4.6 GB installed (~70 s on a fast mirror). PyPI has no CPU-only Linux wheel, and torch
# installed --no-deps does not import without the CUDA libraries.
$(VENV)/.ok: bindings/python/pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q numpy pytest xxhash hypothesis msgspec pyzmq
	$(VPY) -m pip install -q torch==2.11.0 transformers==5.23.0
	@touch $@

fmt:
	gofmt -l -w capi core internal cmd kernels bench

vet: $(KERNELS_DEP)
	@test -z "$$(gofmt -l capi core internal cmd kernels bench)" || { echo "gofmt needed:"; gofmt -l capi core internal cmd kernels bench; exit 1; }
	$(GO) vet $(GO_TAGS) ./...

test-go: $(KERNELS_DEP)
	$(GO) test $(GO_TAGS) -race -count=1 ./...

check-header:
	@mkdir -p $(BUILD)
	printf '#include "kvplug.h"\nint main(void){return 0;}\n' > $(BUILD)/hdr.c
	cc -std=c99 -Wall -Wextra -Werror -pedantic -Iinclude -c $(BUILD)/hdr.c -o $(BUILD)/hdr_c.o
	cp $(BUILD)/hdr.c $(BUILD)/hdr.cpp
	c++ -std=c++17 -Wall -Wextra -Werror -pedantic -Iinclude -c $(BUILD)/hdr.cpp -o $(BUILD)/hdr_cpp.o

check-exports: $(LIB)
	tests/check_exports.sh include/kvplug.h $(LIB)

test-cpp: $(LIB)
	cmake -S . -B $(BUILD)/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVPLUG_LIBRARY=$(abspath $(LIB)) >/dev/null
	cmake --build $(BUILD)/cmake
	cd $(BUILD)/cmake && ctest --output-on-failure

test-python: $(LIB) $(VENV)/.ok
	KVPLUG_LIBRARY=$(abspath $(LIB)) PYTHONPATH=bindings/python $(VPY) -m pytest -q tests/python

# A fresh clone of the working tree, with nvcc and .tools/ out of reach,
# must build, vet and load (tests/fresh_clone.sh).
test-fresh-clone:
	tests/fresh_clone.sh

test: vet check-header check-exports test-go test-cpp test-python test-fresh-clone

demo: $(LIB) $(VENV)/.ok
	KVPLUG_LIBRARY=$(abspath $(LIB)) PYTHONPATH=bindings/python $(VPY) bench/demo.py

# The C++ and Python suites against a race-detector build of the library, not part of
# `make test` (README, "Testing beyond `make test`"). The race runtime's shadow memory
# covers addresses below 0xe000000000 only, and a shared library loads near 0x7f0000000000,
# where the runtime fails at load ("ThreadSanitizer failed to allocate ..."): the race build
# asks the loader for a low base address instead. A race does not change a host's exit
# status, so the reports go to files (GORACE log_path) and any report fails the target.
RACE_LIB     := $(BUILD)/race/libkvplug.so
RACE_REPORTS := $(abspath $(BUILD)/race/reports)

.PHONY: test-race

$(RACE_LIB): $(GO_SRC) $(KERNELS_DEP) $(BUILD)/kernels.setting
	@mkdir -p $(BUILD)/race
	$(GO) build -race -trimpath $(GO_TAGS) -buildmode=c-shared \
		-ldflags='-extldflags=-Wl,-Ttext-segment=0x4000000000' -o $@ ./capi
	@rm -f $(BUILD)/race/libkvplug.h

test-race: $(RACE_LIB) $(VENV)/.ok
	@rm -rf $(RACE_REPORTS) && mkdir -p $(RACE_REPORTS)
	cmake -S . -B $(BUILD)/cmake-race -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVPLUG_LIBRARY=$(abspath $(RACE_LIB)) >/dev/null
	cmake --build $(BUILD)/cmake-race
	@st=0; \
	(cd $(BUILD)/cmake-race && GORACE=log_path=$(RACE_REPORTS)/race ctest --output-on-failure) || st=1; \
	GORACE=log_path=$(RACE_REPORTS)/race KVPLUG_LIBRARY=$(abspath $(RACE_LIB)) PYTHONPATH=bindings/python \
		$(VPY) -m pytest -q tests/python || st=1; \
	if ls $(RACE_REPORTS)/race.* >/dev/null 2>&1; then \
		cat $(RACE_REPORTS)/race.*; echo "test-race: data races reported (above; files in $(RACE_REPORTS))"; st=1; \
	fi; \
	exit $$st

# The engines' conformance tests, not part of `make test` (README, "Using kvplug
# with vLLM / SGLang"): kvplug.vllm and kvplug.sglang driven by vLLM's and SGLang's
# own scheduler-side classes on the CPU, plus the engines' unit tests that can be
# pointed at them. Each engine gets its own environment under build/engines-venv
# (vLLM 0.32 pins torch 2.13, SGLang 0.5.23 torch 2.14.1), installed with uv from
# tests/engines/requirements-*.txt: about 9 GB each (the CUDA torch and its
# libraries: PyPI has no CPU-only Linux torch), a minute each from a fast mirror.
# vLLM's own tests come from its sdist (tests/engines/fetch_upstream.py).
ENGINES_VENV := $(BUILD)/engines-venv
ENGINES_VLLM := 0.32.0
ENGINES_UV := $(ENGINES_VENV)/tools/bin/uv
ENGINES_ENV = KVPLUG_LIBRARY=$(abspath $(LIB)) PYTHONPATH=$(abspath bindings/python) HF_HUB_OFFLINE=1 KVPLUG_GO=$(GO)
ENGINES_PYTEST = -q -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::UserWarning

$(ENGINES_VENV)/tools/.ok:
	$(PYTHON) -m venv $(ENGINES_VENV)/tools
	$(ENGINES_VENV)/tools/bin/pip install -q uv==0.13.9
	@touch $@

$(ENGINES_VENV)/%/.ok: tests/engines/requirements-%.txt $(ENGINES_VENV)/tools/.ok
	rm -rf $(ENGINES_VENV)/$*
	$(ENGINES_UV) venv -q --python $(PYTHON) $(ENGINES_VENV)/$*
	UV_CACHE_DIR=$(abspath $(ENGINES_VENV))/uv-cache $(ENGINES_UV) pip install -q --python $(ENGINES_VENV)/$*/bin/python -r $<
	@touch $@

test-engines: $(LIB) $(ENGINES_VENV)/vllm/.ok $(ENGINES_VENV)/sglang/.ok
	@rm -rf $(ENGINES_VENV)/results && mkdir -p $(ENGINES_VENV)/results
	$(ENGINES_VENV)/vllm/bin/python tests/engines/fetch_upstream.py $(ENGINES_VLLM) $(ENGINES_VENV)/upstream
	-cd tests/engines && $(ENGINES_ENV) $(abspath $(ENGINES_VENV))/vllm/bin/python -m pytest $(ENGINES_PYTEST) \
		--junitxml=$(abspath $(ENGINES_VENV))/results/vllm.xml vllm
	-cd tests/engines && $(ENGINES_ENV) $(abspath $(ENGINES_VENV))/sglang/bin/python -m pytest $(ENGINES_PYTEST) \
		--junitxml=$(abspath $(ENGINES_VENV))/results/sglang.xml sglang
	-cd $(ENGINES_VENV)/upstream/vllm && $(ENGINES_ENV) PYTHONPATH=$(abspath bindings/python):$(abspath tests/engines/vllm) \
		$(abspath $(ENGINES_VENV))/vllm/bin/python -m pytest $(ENGINES_PYTEST) --tb=no -rN -p upstream_shim \
		--junitxml=$(abspath $(ENGINES_VENV))/results/vllm-upstream.xml tests/v1/kv_offload/cpu/test_manager.py
	$(PYTHON) tests/engines/summarize.py $(ENGINES_VENV)/results

# KV-aware routing: three instances, the cluster prefix index against random routing.
demo-routing:
	$(GO) run ./bench/kvroute

bench: $(LIB) $(VENV)/.ok
	$(GO) test $(GO_TAGS) -run '^$$' -bench . -benchmem ./core/... ./internal/...
	KVPLUG_LIBRARY=$(abspath $(LIB)) PYTHONPATH=bindings/python $(VPY) bench/step_cost.py

clean:
	rm -rf $(BUILD) $(KERNELS_FATBIN)

# Mutation testing, not part of `make test`: each mutation of tools/mutate/mutations.txt
# (core/prefix, core/kvmanager, core/kvevents, core/kvtier/host) applied alone to a
# temporary copy of the tree and that package's tests run on it; fails on a survivor the
# list does not mark equivalent (tools/mutate/RESULTS.md). MUTATE_FLAGS: e.g. -pkg core/prefix.
.PHONY: mutate
mutate:
	$(GO) run ./tools/mutate $(MUTATE_FLAGS)
