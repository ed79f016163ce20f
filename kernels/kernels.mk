# Included by the top-level Makefile: the kernel fatbin.
#
# KERNELS=on (the default) builds the kernels, with nvcc from the machine or,
# when it has none, nvcc 13.0 fetched from PyPI into .tools/cuda by
# kernels/build.sh. KERNELS=off (or KVPLUG_KERNELS=off in the environment)
# builds a library without kernels: its kernel calls answer
# KVP_ERR_UNSUPPORTED.
KERNELS        ?= $(or $(KVPLUG_KERNELS),on)
KERNELS_FATBIN := kernels/fatbin/kvplug.fatbin
KERNELS_SRC    := $(wildcard kernels/*.cu kernels/*.cuh kernels/*.h) kernels/build.sh kernels/nvcc-requirements.txt

ifeq ($(KERNELS),on)
KERNELS_DEP  := $(KERNELS_FATBIN)
GO_TAGS      :=
else ifeq ($(KERNELS),off)
KERNELS_DEP  :=
GO_TAGS      := -tags kvplug_nokernels
else
$(error KERNELS must be on or off, not '$(KERNELS)')
endif

$(KERNELS_FATBIN): $(KERNELS_SRC)
	kernels/build.sh $@

kernels: $(KERNELS_FATBIN)
