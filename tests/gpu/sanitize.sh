#!/usr/bin/env bash
# compute-sanitizer's memcheck and racecheck over the GPU tests that run the Hopper (sm_90a)
# kernels: paged prefill (test_prefill_torch.py's Hopper cases) and the cascade route's wgmma
# launch (test_cascade_torch.py). Only the kernels whose names hold "sm90" are instrumented,
# so the float64 references run at full speed; torch's caching allocator is off, so that a
# read past a tensor's end lands outside every allocation and memcheck sees it. Exits non-zero
# at the first tool that reports an error or hazard. About 5 minutes on an H100.
#   KVPLUG_LIBRARY=$PWD/build/libkvplug.so PYTHONPATH=bindings/python tests/gpu/sanitize.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${KVPLUG_LIBRARY:?set KVPLUG_LIBRARY to the built libkvplug.so}"
command -v compute-sanitizer >/dev/null || { echo "sanitize.sh: compute-sanitizer (CUDA toolkit) is not on PATH" >&2; exit 2; }
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
check() {  # tool, test file, -k selection
    echo "== $1: $2 -k \"$3\""
    compute-sanitizer --tool "$1" --kernel-name kns=sm90 --error-exitcode 9 --print-limit 20 \
        python3 -m pytest -q -x -p no:cacheprovider "tests/gpu/$2" -k "$3"
}
check memcheck test_prefill_torch.py "hopper and (test_prefill or split_kv or sliding_window or graph or one_plan or mixed_batch_decode)"
check memcheck test_cascade_torch.py "prefill_matches or matches_reference"
check racecheck test_prefill_torch.py "hopper and test_prefill and 128-16-1"
check racecheck test_prefill_torch.py "hopper and split_kv"
check racecheck test_cascade_torch.py "prefill_matches"
