#!/usr/bin/env bash
# Shows the matrix instructions of the Hopper prefill kernels in the sm_90a machine code of
# the fatbin (HGMMA, and QGMMA for the 8-bit products: wgmma on the tensor cores; HMMA would be the older mma.sync path), and
# their register and spill counts; and fails where any kernel has an async copy (LDGSTS)
# whose shared address is a register plus a uniform register: ptxas 13.0 emits that form
# where it can split a cp.async's shared address into a uniform base and a per-thread part,
# and with an L2 cache hint it pairs it with a cache-policy register that nothing sets
# (desc[UR1] in the SASS, never written): an illegal instruction on sm_90a. Needs cuobjdump
# (CUDA toolkit) on PATH.
#   bench/sass_check.sh [kernels/fatbin/kvplug.fatbin]
set -euo pipefail
fatbin=${1:-kernels/fatbin/kvplug.fatbin}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cuobjdump -sass "$fatbin" >"$tmp/sass"
status=0
for k in $(grep -o 'Function : kvp_paged_prefill_sm90_[a-z0-9_]*' "$tmp/sass" | awk '{print $3}' | sort -u); do
    body=$(awk -v k="$k" '/Function : /{on = ($3 == k)} on' "$tmp/sass")
    hg=$(grep -cE '[HQ]GMMA' <<<"$body" || true)
    hm=$(grep -c ' HMMA' <<<"$body" || true)
    ldl=$(grep -cE ' (LDL|STL)' <<<"$body" || true)
    printf '%-40s GMMA %3d  HMMA %3d  local loads/stores %3d\n' "$k" "$hg" "$hm" "$ldl"
    [ "$hg" -gt 0 ] || status=1
done
bad=$(awk '/Function : /{k = $3} /LDGSTS/ && /\[R[0-9]+\+UR[0-9]+/ {print k}' "$tmp/sass" | sort | uniq -c)
if [ -n "$bad" ]; then
    echo "LDGSTS with a register + uniform register shared address (faults on sm_90a):"
    echo "$bad"
    status=1
fi
exit $status
