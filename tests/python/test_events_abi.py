"""The event publisher's ctypes structs against include/kvplug.h: size and
every field's offset (a C program compiled against the header prints
them), the defaults of KVP_EVENT_PUBLISHER_CONFIG_INIT and the constants."""

from __future__ import annotations

import ctypes
import pathlib
import re
import shutil
import subprocess

import pytest

from kvplug import events

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER = ROOT / "include" / "kvplug.h"
STRUCTS = {events.EventPublisherConfig: "kvp_event_publisher_config",
           events.EventPublisherStatsStruct: "kvp_event_publisher_stats"}


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_layouts_and_defaults(tmp_path):
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "kvplug.h"', "int main(void) {",
             "  kvp_event_publisher_config c = KVP_EVENT_PUBLISHER_CONFIG_INIT;",
             '  printf("init dp %d bind %d size %zu\\n", c.data_parallel_rank, c.bind_mode, c.struct_size);']
    for cls, cname in STRUCTS.items():
        lines.append(f'  printf("{cname} size %zu\\n", sizeof({cname}));')
        for field, _ in cls._fields_:
            lines.append(f'  printf("{cname} {field} %zu\\n", offsetof({cname}, {field}));')
    for name in ("BIND_VLLM", "BIND", "CONNECT", "FORMAT_MAP", "FORMAT_ARRAY", "HASH_BYTES", "HASH_INT64"):
        lines.append(f'  printf("enum {name} %d\\n", (int)KVP_EVENTS_{name});')
    lines += ["  return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    cc = subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", f"-I{HEADER.parent}", str(src), "-o", str(tmp_path / "layout")],
                        capture_output=True, text=True)
    assert cc.returncode == 0, cc.stderr
    out = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.splitlines()
    init = out[0].split()
    assert init[2] == "0" and init[4] == "0" and int(init[6]) == ctypes.sizeof(events.EventPublisherConfig)
    c = {}
    for line in out[1:]:
        a, b, v = line.split()
        c[(a, b)] = int(v)
    for cls, cname in STRUCTS.items():
        assert ctypes.sizeof(cls) == c[(cname, "size")], cname
        for field, _ in cls._fields_:
            assert getattr(cls, field).offset == c[(cname, field)], f"{cname}.{field}"
    for name in ("BIND_VLLM", "BIND", "CONNECT", "FORMAT_MAP", "FORMAT_ARRAY", "HASH_BYTES", "HASH_INT64"):
        assert getattr(events, name) == c[("enum", name)], name


def test_header_fields_are_all_mirrored():
    text = HEADER.read_text()
    for cls, cname in STRUCTS.items():
        body = re.search(r"typedef struct " + cname + r" \{(.*?)\} " + cname + ";", text, re.S).group(1)
        body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
        fields = re.findall(r"^\s*[\w\s\*]+?\b(\w+);", body, re.M)
        assert fields == [f for f, _ in cls._fields_], cname
