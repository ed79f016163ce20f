#!/usr/bin/env bash
# compute-sanitizer's memcheck and racecheck over the GPU tests of the attention tiles: paged
# prefill on the Hopper (sm_90a) mainloop and on the sm_80 tile (test_prefill_torch.py's
# "hopper" and "sm80" cases), the cascade route's kernels (test_cascade_torch.py), and the
# e4m3 (FP8) cache's KV write, decode, prefill on both mainloops and in the FP8 Q/K/V mode, and cascade (test_fp8_torch.py). Only
# the kernels whose names hold the given part are instrumented, so the float64 references run
# at full speed; torch's caching allocator is off, so that a read past a tensor's end lands
# outside every allocation and memcheck sees it. Exits non-zero at the first tool that
# reports an error or hazard, and when a selection runs no test: KVPLUG_REQUIRE_GPU=1 makes a
# skipped test fail, and a -k that matches nothing is an error here. About 6 minutes on an H100.
#   KVPLUG_LIBRARY=$PWD/build/libkvplug.so PYTHONPATH=bindings/python tests/gpu/sanitize.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${KVPLUG_LIBRARY:?set KVPLUG_LIBRARY to the built libkvplug.so}"
command -v compute-sanitizer >/dev/null || { echo "sanitize.sh: compute-sanitizer (CUDA toolkit) is not on PATH" >&2; exit 2; }
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
export KVPLUG_REQUIRE_GPU=1
check() {  # tool, kernel-name part, test file, -k selection
    echo "== $1 ($2): $3 -k \"$4\""
    local rc=0
    compute-sanitizer --tool "$1" --kernel-name "kns=$2" --error-exitcode 9 --print-limit 20 \
        python3 -m pytest -q -x -p no:cacheprovider "tests/gpu/$3" -k "$4" || rc=$?
    # pytest's 5: no test was collected (the -k matches none), which would check nothing.
    if [ "$rc" -eq 5 ]; then
        echo "sanitize.sh: no test of $3 matches -k \"$4\"" >&2
        exit 5
    fi
    [ "$rc" -eq 0 ] || exit "$rc"
}
check memcheck sm90 test_prefill_torch.py "hopper and (test_prefill or split_kv or sliding_window or graph or one_plan or mixed_batch_decode)"
check memcheck sm90 test_cascade_torch.py "prefill_matches or matches_reference"
check racecheck sm90 test_prefill_torch.py "hopper and test_prefill and 128-16-1"
check racecheck sm90 test_prefill_torch.py "hopper and split_kv"
check racecheck sm90 test_cascade_torch.py "prefill_matches"
check memcheck kvp_paged_prefill test_prefill_torch.py "sm80 and (test_prefill or sliding_window)"
check racecheck kvp_paged_prefill test_prefill_torch.py "sm80 and (test_prefill and 128-16-1 or sliding_window)"
check racecheck kvp_cascade test_cascade_torch.py "prefill_matches or matches_reference"
check memcheck e4m3 test_fp8_torch.py "write_and_decode and 128 or fp8_prefill and 128 or fp8_cascade and device"
check racecheck e4m3 test_fp8_torch.py "write_and_decode and 128 or fp8_prefill and 128"
check racecheck e4m3 test_fp8_torch.py "prefill_long and one-split-64 or fp8_cascade and device and 256"
check memcheck e4m3 test_fp8_torch.py "fp8_decode_sweep"
check racecheck e4m3 test_fp8_torch.py "fp8_decode_sweep"
check memcheck e4m3_qkv test_fp8_torch.py "qkv_prefill or qkv_graph"
check racecheck e4m3_qkv test_fp8_torch.py "qkv_prefill and token-dtype1 or qkv_prefill_long and one-split-dtype0"
