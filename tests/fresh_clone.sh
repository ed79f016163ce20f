#!/usr/bin/env bash
# What a newcomer gets from a fresh clone on a machine without nvcc: copies
# the working tree as a clone would have it (tracked and untracked files that
# git does not ignore; no .tools/, no fatbin, no build/) into a temporary
# directory, hides every nvcc, and checks there that
#   1. `go vet ./...` and `go build ./...` pass without the fatbin;
#   2. the library built without the fatbin loads, runs its CPU parts, and
#      answers kernel calls with KVP_ERR_UNSUPPORTED and how to build them;
#   3. `make lib` builds the library with its kernels, fetching nvcc itself
#      (pip's cache makes this quick after the first time);
#   4. `pip wheel` builds a wheel that installs into a new venv and runs the
#      README's Python quick start outside the checkout, kernels included.
# KVPLUG_FRESH_CLONE_KEEP=1 keeps the directory for a look afterwards.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/kvplug-fresh.XXXXXX")"
[ -n "${KVPLUG_FRESH_CLONE_KEEP:-}" ] || trap 'rm -rf "$tmp"' EXIT
clone="$tmp/kvplug"
mkdir -p "$clone"
step() { printf 'fresh clone: %s\n' "$*"; }

cd "$root"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    [ -e "$f" ] || continue  # deleted in the working tree
    mkdir -p "$clone/$(dirname "$f")"
    cp -p "$f" "$clone/$f"
done
step "copied $(cd "$clone" && find . -type f | wc -l) files into $clone"

# No nvcc anywhere: not in PATH, not in NVCC, not under CUDA_HOME.
path=""
IFS=: read -r -a dirs <<<"$PATH"
for d in "${dirs[@]}"; do
    [ -n "$d" ] && [ ! -x "$d/nvcc" ] && path="${path:+$path:}$d"
done
export PATH="$path" CUDA_HOME="$tmp/no-cuda"
unset NVCC KVPLUG_KERNELS KERNELS
if command -v nvcc >/dev/null 2>&1; then
    echo "fresh clone: nvcc is still reachable at $(command -v nvcc)" >&2
    exit 1
fi
[ ! -e "$clone/.tools" ] && [ ! -e "$clone/kernels/fatbin/kvplug.fatbin" ] || {
    echo "fresh clone: the copy holds ignored build outputs" >&2; exit 1; }

cd "$clone"
step "go vet ./... and go build ./... without nvcc or fatbin"
go vet ./...
go build ./...

step "library without kernels: loads, CPU parts work, kernel calls answer UNSUPPORTED"
mkdir -p "$tmp/nokernels"
go build -trimpath -buildmode=c-shared -o "$tmp/nokernels/libkvplug.so" ./capi
cc -std=c99 -Wall -Wextra -Werror -pedantic -Iinclude tests/c/kernels_built.c \
    -L"$tmp/nokernels" -lkvplug -Wl,-rpath,"$tmp/nokernels" -o "$tmp/kernels_built"
"$tmp/kernels_built" without

step "make lib: fetches nvcc from PyPI and builds the library with its kernels"
start=$SECONDS
make --no-print-directory lib
[ -x .tools/cuda/bin/python ] || { echo "fresh clone: make lib built without fetching nvcc into .tools/cuda" >&2; exit 1; }
cc -std=c99 -Iinclude tests/c/kernels_built.c -Lbuild -lkvplug -Wl,-rpath,"$clone/build" -o "$tmp/kernels_built"
"$tmp/kernels_built" with
step "make lib took $((SECONDS - start)) s"

step "pip wheel ./bindings/python, installed into a new venv, run outside the checkout"
python3 -m venv "$tmp/build-env"
"$tmp/build-env/bin/pip" wheel -q --disable-pip-version-check --no-deps ./bindings/python -w "$tmp/dist"
python3 -m venv "$tmp/user-env"
"$tmp/user-env/bin/pip" install -q --disable-pip-version-check "$tmp"/dist/kvplug-*.whl
python3 tests/readme_snippets.py show "### Python" python >"$tmp/quickstart.py"
cat >"$tmp/kernels_in_wheel.py" <<'PY'
import ctypes, pathlib, sys
import kvplug
lib = ctypes.CDLL(str(pathlib.Path(kvplug.__file__).parent / "libkvplug.so"))
st = lib.kvp_attn_prepare()  # 0 on a GPU machine, NO_DEVICE (9) elsewhere
lib.kvp_last_error.restype = ctypes.c_char_p
if st not in (0, 9):
    sys.exit(f"the wheel's library: kvp_attn_prepare gave status {st}: {lib.kvp_last_error().decode()}")
print("the wheel's library carries its kernels:", pathlib.Path(kvplug.__file__).parent)
PY
(cd "$tmp" && env -u KVPLUG_LIBRARY -u PYTHONPATH "$tmp/user-env/bin/python" quickstart.py \
    && env -u KVPLUG_LIBRARY -u PYTHONPATH "$tmp/user-env/bin/python" kernels_in_wheel.py)

step "make KERNELS=off lib: a library without kernels, chosen explicitly"
make --no-print-directory KERNELS=off lib
"$tmp/kernels_built" without
step "ok"
