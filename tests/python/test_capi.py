"""kvplug._capi.FUNCTIONS, the one table of the C functions the package
calls, against include/kvplug.h's prototypes (every function, with its
argument count and return kind), and kvplug._lib.C, the table bound once
when the library loads."""

from __future__ import annotations

import ctypes
import pathlib
import re

import pytest

import kvplug
from kvplug import _capi, _lib

HEADER = pathlib.Path(__file__).resolve().parents[2] / "include" / "kvplug.h"
RETURNS = {"kvp_status": ctypes.c_int, "void": None, "uint32_t": ctypes.c_uint32, "const char *": ctypes.c_char_p}


def prototypes() -> dict:
    """{name: (return type, argument count)} of the header's functions."""
    text = HEADER.read_text()
    found = {}
    for m in re.finditer(r"^(kvp_status|void|uint32_t|const char \*)\s*(kvp_\w+)\(([^)]*)\);", text, re.M):
        args = m.group(3).strip()
        found[m.group(2)] = (m.group(1), 0 if args == "void" else args.count(",") + 1)
    return found


def test_the_table_is_the_headers_functions():
    protos = prototypes()
    assert len(protos) > 50
    assert set(_capi.FUNCTIONS) == set(protos)
    for name, (restype, argtypes) in _capi.FUNCTIONS.items():
        ret, nargs = protos[name]
        assert restype is RETURNS[ret], name
        assert len(argtypes) == nargs, name


def test_bound_once_with_the_tables_signature():
    kvplug.version()  # loads the library
    for name, (restype, argtypes) in _capi.FUNCTIONS.items():
        f = getattr(_lib.C, name)
        assert f is getattr(_lib.C, name), name
        assert f.restype is restype and f.argtypes == argtypes, name
        assert f is not _lib.fn(name, restype, argtypes), "fn() binds its own function objects"


def test_unknown_names():
    with pytest.raises(AttributeError, match="not a function of include/kvplug.h"):
        _lib.C.kvp_not_there


def test_a_function_the_library_lacks(monkeypatch):
    kvplug.version()
    monkeypatch.delitem(_lib.C.__dict__, "kvp_vcache_trim")  # as if the library were older than the table
    with pytest.raises(kvplug.LibraryLoadError, match="has no function kvp_vcache_trim"):
        _lib.C.kvp_vcache_trim
    assert _lib.C.kvp_vcache_step  # the others still serve
