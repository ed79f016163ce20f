#!/usr/bin/env bash
# Compiles kernels/kvplug_kernels.cu into a fatbin: machine code for sm_80,
# sm_86, sm_89, sm_90 and PTX for compute_90 (newer GPUs JIT it).
# nvcc is taken from $NVCC, then PATH, then /usr/local/cuda/bin, then the
# PyPI wheels in .tools/cuda (see kernels/README.md).
# Usage: kernels/build.sh [output]   (default kernels/kvplug.fatbin)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
out="${1:-$here/kvplug.fatbin}"

find_nvcc() {
    if [ -n "${NVCC:-}" ]; then echo "$NVCC"; return; fi
    if command -v nvcc >/dev/null 2>&1; then command -v nvcc; return; fi
    if [ -x /usr/local/cuda/bin/nvcc ]; then echo /usr/local/cuda/bin/nvcc; return; fi
    local w
    for w in "$root"/.tools/cuda/lib/python3*/site-packages/nvidia/cu13/bin/nvcc; do
        if [ -x "$w" ]; then echo "$w"; return; fi
    done
    echo "kernels/build.sh: nvcc not found (set NVCC, install the CUDA 13.0 toolkit, or run 'make tools')" >&2
    exit 1
}
nvcc="$(find_nvcc)"

# The wheel's nvcc finds its own include/ (nvcc.profile); with the split
# wheels of older layouts the runtime headers live beside it, so add them.
extra=()
inc="$(cd "$(dirname "$nvcc")/.." && pwd)/include"
[ -f "$inc/cuda_runtime.h" ] && extra+=(-I"$inc")

tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
"$nvcc" -fatbin -std=c++17 -O3 -lineinfo --threads 0 \
    -gencode=arch=compute_80,code=sm_80 \
    -gencode=arch=compute_86,code=sm_86 \
    -gencode=arch=compute_89,code=sm_89 \
    -gencode=arch=compute_90,code=sm_90 \
    -gencode=arch=compute_90,code=compute_90 \
    ${KVP_NVCC_FLAGS:-} "${extra[@]}" \
    -o "$tmp" "$here/kvplug_kernels.cu"
mv "$tmp" "$out"
