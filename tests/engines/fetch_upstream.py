"""Fetches the pinned vLLM sdist from PyPI (the release's own tests are in
it, not in the wheel), checks it against the sha256 PyPI's simple index
gives for it, and extracts the unit tests make test-engines runs against
kvplug.vllm into DEST/vllm/.

    python tests/engines/fetch_upstream.py VERSION DEST

SGLang publishes no sdist for its pinned release; the storage backends'
unit tests it ships inside its wheel are used from the installed package.
"""

from __future__ import annotations

import hashlib
import io
import pathlib
import re
import sys
import tarfile
import urllib.request

MEMBERS = ("tests/v1/kv_offload/cpu/test_manager.py",)


def main() -> None:
    version, dest = sys.argv[1], pathlib.Path(sys.argv[2])
    out = dest / "vllm"
    if all((out / m).exists() for m in MEMBERS):
        return
    index = urllib.request.urlopen("https://pypi.org/simple/vllm/", timeout=60).read().decode()
    m = re.search(r'href="([^"#]*/vllm-' + re.escape(version) + r'\.tar\.gz)#sha256=([0-9a-f]{64})"', index)
    if m is None:
        sys.exit(f"fetch_upstream: no vllm-{version}.tar.gz on PyPI's simple index")
    url, sha = m.groups()
    data = urllib.request.urlopen(url, timeout=600).read()
    if hashlib.sha256(data).hexdigest() != sha:
        sys.exit(f"fetch_upstream: {url} does not match the index's sha256 {sha}")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in MEMBERS:
            f = tar.extractfile(f"vllm-{version}/{member}")
            if f is None:
                sys.exit(f"fetch_upstream: {member} is not in vllm-{version}.tar.gz")
            path = out / member
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(f.read())
    print(f"fetch_upstream: vllm-{version} tests in {out}")


if __name__ == "__main__":
    main()
