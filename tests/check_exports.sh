#!/usr/bin/env bash
# Checks that the shared library exports every function the header declares.
# usage: tests/check_exports.sh include/kvplug.h build/libkvplug.so
set -euo pipefail
header=${1:?usage: $0 HEADER LIBRARY}
lib=${2:?usage: $0 HEADER LIBRARY}

# Declared functions: kvp_ identifiers directly followed by '(' outside
# comments (function-like macros are upper case, so KVP_ ones never match).
declared=$(sed -e 's://.*$::' "$header" |
  perl -0777 -pe 's:/\*.*?\*/::gs' |
  grep -oE '\bkvp_[a-z0-9_]+[[:space:]]*\(' | sed -E 's/[[:space:]]*\($//' | sort -u)
if [ -z "$declared" ]; then
  echo "check_exports: no kvp_ functions found in $header" >&2
  exit 1
fi
exported=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TtWi]$/ {print $3}' | sed 's/@.*//' | sort -u)

missing=$(comm -23 <(printf '%s\n' "$declared") <(printf '%s\n' "$exported"))
if [ -n "$missing" ]; then
  echo "check_exports: $lib does not export these functions declared in $header:" >&2
  printf '  %s\n' $missing >&2
  exit 1
fi
echo "check_exports: all $(printf '%s\n' "$declared" | wc -l) functions declared in $header are exported by $lib"
