#!/usr/bin/env bash
# Compiles kernels/kvplug_kernels.cu into a fatbin: machine code for sm_80,
# sm_86, sm_89, sm_90 and PTX for compute_90 (newer GPUs JIT it).
#
# nvcc is taken from $NVCC, then PATH, then $CUDA_HOME/bin (default
# /usr/local/cuda), then .tools/cuda. When none has it, the pinned nvcc 13.0
# wheels of kernels/nvcc-requirements.txt are installed from PyPI into
# .tools/cuda first (about 97 MB to download; $PYTHON or python3 makes the
# venv). KVPLUG_KERNELS=off anywhere in the build skips the kernels instead.
#
# Usage: kernels/build.sh [output]   (default kernels/fatbin/kvplug.fatbin)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
out="${1:-$here/fatbin/kvplug.fatbin}"
tools="$root/.tools/cuda"

# Nothing to do when the fatbin is newer than every source (pip builds call
# this script without make's dependency check).
if [ -f "$out" ] && [ -z "$(find "$here" -maxdepth 1 \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name build.sh -o -name nvcc-requirements.txt \) -newer "$out")" ]; then
    echo "kernels/build.sh: ${out#"$root"/} is up to date" >&2
    exit 0
fi

fail() {
    echo "kernels/build.sh: $*" >&2
    exit 1
}

wheel_nvcc() {
    local w
    for w in "$tools"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc; do
        if [ -x "$w" ]; then echo "$w"; return 0; fi
    done
    return 1
}

find_nvcc() {
    if [ -n "${NVCC:-}" ]; then
        [ -x "$NVCC" ] || fail "NVCC=$NVCC is not an executable"
        echo "$NVCC"; return 0
    fi
    if command -v nvcc >/dev/null 2>&1; then command -v nvcc; return 0; fi
    local cuda="${CUDA_HOME:-/usr/local/cuda}"
    if [ -x "$cuda/bin/nvcc" ]; then echo "$cuda/bin/nvcc"; return 0; fi
    wheel_nvcc
}

fetch_nvcc() {
    local py="${PYTHON:-python3}"
    command -v "$py" >/dev/null 2>&1 || fail "no nvcc on this machine, and no $py to fetch it from PyPI with (install python3 and python3-venv, or the CUDA 13.0 toolkit, or build without kernels: KVPLUG_KERNELS=off)"
    echo "kernels/build.sh: no nvcc found (NVCC, PATH, ${CUDA_HOME:-/usr/local/cuda}/bin); installing nvcc 13.0 from PyPI into .tools/cuda: nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-crt, nvidia-cuda-runtime (about 97 MB to download, 280 MB installed)" >&2
    rm -rf "$tools"
    local log="$root/.tools/cuda-install.log"
    mkdir -p "$root/.tools"
    if ! { "$py" -m venv "$tools" && "$tools/bin/python" -m pip install -q --disable-pip-version-check \
            --require-hashes -r "$here/nvcc-requirements.txt"; } >"$log" 2>&1; then
        cat "$log" >&2
        rm -rf "$tools"
        fail "installing nvcc from PyPI failed (the output above; also in .tools/cuda-install.log). Install the CUDA 13.0 toolkit, set NVCC, or build without kernels: KVPLUG_KERNELS=off"
    fi
    wheel_nvcc || fail "the nvcc wheels installed but .tools/cuda has no nvcc (unexpected wheel layout)"
}

nvcc="$(find_nvcc)" || {
    # One fetch at a time: parallel builds (make -j, pip) wait for the first.
    mkdir -p "$root/.tools"
    exec 9>"$root/.tools/.lock"
    flock 9
    nvcc="$(wheel_nvcc)" || nvcc="$(fetch_nvcc)"
    exec 9>&-
}
vout="$("$nvcc" --version 2>&1)" || fail "$nvcc does not run: '$nvcc --version' failed"
version="$(sed -n 's/.*release \([0-9][0-9.]*\).*/\1/p' <<<"$vout" | head -1)"
echo "kernels/build.sh: nvcc ${version:-of unknown version} at $nvcc" >&2
case "$version" in
    1[3-9].*|[2-9][0-9].*) ;;
    *) echo "kernels/build.sh: warning: the kernels are built and tested with nvcc 13.0; this one is ${version:-unknown}" >&2 ;;
esac

# The wheel's nvcc finds its own include/ (nvcc.profile); with the split
# wheels of older layouts the runtime headers live beside it, so add them.
extra=()
inc="$(cd "$(dirname "$nvcc")/.." && pwd)/include"
[ -f "$inc/cuda_runtime.h" ] && extra+=(-I"$inc")

mkdir -p "$(dirname "$out")"
tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
start=$SECONDS
"$nvcc" -fatbin -std=c++17 -O3 -lineinfo --threads 0 \
    -gencode=arch=compute_80,code=sm_80 \
    -gencode=arch=compute_86,code=sm_86 \
    -gencode=arch=compute_89,code=sm_89 \
    -gencode=arch=compute_90a,code=sm_90a \
    -gencode=arch=compute_90,code=compute_90 \
    ${KVP_NVCC_FLAGS:-} "${extra[@]}" \
    -o "$tmp" "$here/kvplug_kernels.cu" || fail "nvcc failed to compile kernels/kvplug_kernels.cu (errors above)"
mv "$tmp" "$out"
echo "kernels/build.sh: wrote ${out#"$root"/} ($(( $(wc -c <"$out") / 1024 )) KiB) in $(( SECONDS - start )) s" >&2
