"""Prints make test-engines' pass counts from the suites' JUnit XML files,
and fails when one of our suites failed or an upstream test that passed
against kvplug (vllm/upstream_expected_pass.txt) no longer does.

    python tests/engines/summarize.py DIR
"""

from __future__ import annotations

import pathlib
import sys
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).resolve().parent
SUITES = [
    ("vllm", "kvplug.vllm through vLLM's Scheduler + OffloadingConnector, hybrid full + window groups, manager faults"),
    ("sglang", "kvplug.sglang through SGLang's HiCacheController + storage factory, Mooncake unit test"),
    ("vllm-upstream", "vLLM 0.32.0 tests/v1/kv_offload/cpu/test_manager.py against kvplug's manager"),
]


def cases(path: pathlib.Path):
    for tc in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in tc}
        if "skipped" in kinds:
            state = "xfail" if any("xfail" in (c.get("type") or "") or "xfail" in (c.get("message") or "")
                                   for c in tc if c.tag == "skipped") else "skipped"
        elif kinds & {"failure", "error"}:
            state = "failed"
        else:
            state = "passed"
        yield tc.get("name"), state


def main() -> int:
    out = pathlib.Path(sys.argv[1])
    bad = 0
    print("make test-engines:")
    for name, what in SUITES:
        path = out / f"{name}.xml"
        if not path.exists():
            print(f"  {name:14s} not run")
            bad += 1
            continue
        got = dict(cases(path))
        counts = {s: sum(1 for v in got.values() if v == s) for s in ("passed", "failed", "skipped", "xfail")}
        print(f"  {name:14s} {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped, "
              f"{counts['xfail']} expected failures  ({what})")
        if name == "vllm-upstream":
            want = [ln.strip() for ln in (HERE / "vllm" / "upstream_expected_pass.txt").read_text().splitlines()
                    if ln.strip() and not ln.startswith("#")]
            lost = [t for t in want if got.get(t) != "passed"]
            for t in lost:
                print(f"    no longer passes: {t}")
            bad += len(lost)
        else:
            bad += counts["failed"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
