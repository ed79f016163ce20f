# Included by the top-level Makefile: the kernel fatbin and the nvcc wheels.
KERNELS_FATBIN := kernels/kvplug.fatbin
KERNELS_SRC    := $(wildcard kernels/*.cu kernels/*.cuh kernels/*.h) kernels/build.sh
CUDA_WHEELS    := nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.*

$(KERNELS_FATBIN): $(KERNELS_SRC)
	kernels/build.sh $@

kernels: $(KERNELS_FATBIN)

# nvcc 13.0 from PyPI into .tools/cuda when the machine has no CUDA toolkit.
tools:
	@if [ -n "$$NVCC" ] || command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] \
	    || ls .tools/cuda/lib/python3*/site-packages/nvidia/cu13/bin/nvcc >/dev/null 2>&1; then \
	    echo "nvcc present"; \
	else \
	    $(PYTHON) -m venv .tools/cuda && \
	    .tools/cuda/bin/pip install -q $(foreach w,$(CUDA_WHEELS),'$(w)'); \
	fi
