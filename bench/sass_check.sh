#!/usr/bin/env bash
# Shows the matrix instructions of the Hopper prefill kernels in the sm_90a machine code of
# the fatbin (HGMMA: wgmma on the tensor cores; HMMA would be the older mma.sync path), and
# their register and spill counts. Needs cuobjdump (CUDA toolkit) on PATH.
#   bench/sass_check.sh [kernels/fatbin/kvplug.fatbin]
set -euo pipefail
fatbin=${1:-kernels/fatbin/kvplug.fatbin}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cuobjdump -sass "$fatbin" >"$tmp/sass"
status=0
for k in $(grep -o 'Function : kvp_paged_prefill_sm90_[a-z0-9_]*' "$tmp/sass" | awk '{print $3}' | sort -u); do
    body=$(awk -v k="$k" '/Function : /{on = ($3 == k)} on' "$tmp/sass")
    hg=$(grep -c 'HGMMA' <<<"$body" || true)
    hm=$(grep -c ' HMMA' <<<"$body" || true)
    ldl=$(grep -cE ' (LDL|STL)' <<<"$body" || true)
    printf '%-40s HGMMA %3d  HMMA %3d  local loads/stores %3d\n' "$k" "$hg" "$hm" "$ldl"
    [ "$hg" -gt 0 ] || status=1
done
exit $status
