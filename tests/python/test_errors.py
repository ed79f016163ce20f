"""Every bad-input case of the manager through ctypes: each raises the
exception of its own status, carrying the library's message, and changes
nothing. Cases the Python API cannot produce (NULL pointers, struct sizes)
call the C functions directly through kvplug._lib.fn."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from conftest import ids

import kvplug
from kvplug import _lib
from kvplug.manager import BlockCopy, ManagerConfig, ManagerStatsStruct

vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
HUGE = 2**20 + 1  # one past the largest batch


def raises(exc, needle):
    """pytest.raises that also checks status and message."""
    return pytest.raises(exc, match=needle)


# ---- exceptions themselves -------------------------------------------------------


def test_every_status_has_its_own_exception():
    classes = {_lib.error_for(s, "m").__class__ for s in range(1, 15)}
    assert len(classes) == 14
    for s in range(1, 15):
        e = _lib.error_for(s, "msg")
        assert isinstance(e, kvplug.KvplugError)
        assert e.status == s and str(e) == "msg"
        assert e.status_name == "KVP_ERR_" + kvplug.Status(s).name


def test_unknown_status_is_a_plain_kvplug_error():
    e = _lib.error_for(99, "new code")
    assert type(e) is kvplug.KvplugError and e.status == 99 and e.status_name == "kvp_status(99)"


def test_builtin_bases():
    assert issubclass(kvplug.InvalidArgumentError, ValueError)
    assert issubclass(kvplug.UnknownSequenceError, KeyError)
    assert issubclass(kvplug.BufferTooSmallError, ValueError)
    assert issubclass(kvplug.InternalError, RuntimeError)
    assert str(kvplug.UnknownSequenceError("no quotes", 5)) == "no quotes"  # KeyError would quote


def test_exceptions_pickle():
    import pickle

    e = pickle.loads(pickle.dumps(_lib.error_for(7, "grow: out")))
    assert type(e) is kvplug.OutOfBlocksError and e.status == 7 and str(e) == "grow: out"


# ---- creation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_blocks, block_size, needle",
    [(0, 16, "got 0"), (-3, 16, "-3"), (8, -1, "got -1"), (8, 2**16 + 1, "65537"), (2**16, 2**16, "2\\^31")],
    ids=["zero_blocks", "negative_blocks", "negative_block_size", "huge_block_size", "slots_past_int32"],
)
def test_create_invalid(num_blocks, block_size, needle):
    with raises(kvplug.InvalidArgumentError, needle):
        kvplug.Manager(num_blocks, block_size)


def test_create_values_past_int32():
    with raises(kvplug.InvalidArgumentError, "num_blocks must be in \\[-2\\^31, 2\\^31-1\\]: got 1099511627776"):
        kvplug.Manager(2**40)


def create_raw(cfg, out):
    return _lib.fn("kvp_manager_create", ctypes.c_int, [vp, vp])(cfg, out)


def test_create_null_config():
    out = vp()
    assert create_raw(None, ctypes.addressof(out)) == kvplug.Status.NULL_POINTER
    assert "NULL" in _lib.last_error() and out.value is None


def test_create_null_out():
    cfg = ManagerConfig(ctypes.sizeof(ManagerConfig), 8, 16)
    assert create_raw(ctypes.addressof(cfg), None) == kvplug.Status.NULL_POINTER
    assert "NULL" in _lib.last_error()


def test_block_size_zero_is_the_default_in_c_and_refused_in_python():
    cfg = ManagerConfig(ctypes.sizeof(ManagerConfig), 8, 0)
    out = vp()
    assert create_raw(ctypes.addressof(cfg), ctypes.addressof(out)) == kvplug.Status.OK
    s = ManagerStatsStruct()
    s.struct_size = ctypes.sizeof(s)
    assert _lib.fn("kvp_manager_stats_get", ctypes.c_int, [vp, vp])(out, ctypes.addressof(s)) == kvplug.Status.OK
    _lib.fn("kvp_manager_destroy", None, [vp])(out)
    assert s.block_size == 16
    # A Python caller leaves the argument out for the default: a 0 is a mistake.
    with raises(kvplug.InvalidArgumentError, "block_size must be >= 1 .*got 0"):
        kvplug.Manager(8, 0)
    with kvplug.Manager(8) as m:
        assert m.block_size == 16


def test_create_struct_of_a_newer_header():
    """A larger struct_size is accepted while the bytes past this library's
    struct are 0, and refused once one is set (it would be ignored)."""

    class Newer(ctypes.Structure):
        _fields_ = [("cfg", ManagerConfig), ("newer_field", ctypes.c_int64)]

    big = Newer(ManagerConfig(ctypes.sizeof(Newer), 8, 16), 0)
    out = vp()
    assert create_raw(ctypes.addressof(big), ctypes.addressof(out)) == kvplug.Status.OK
    _lib.fn("kvp_manager_destroy", None, [vp])(out)
    big.newer_field = 7
    out = vp()
    st = create_raw(ctypes.addressof(big), ctypes.addressof(out))
    assert st == kvplug.Status.STRUCT_SIZE and out.value is None
    with raises(kvplug.StructSizeError, "newer kvplug.h"):
        _lib.check(st)


@pytest.mark.parametrize("size", [0, ManagerConfig.block_size.offset, 1 << 20])
def test_create_wrong_struct_size(size):
    cfg = ManagerConfig(size, 8, 16)
    out = vp()
    st = create_raw(ctypes.addressof(cfg), ctypes.addressof(out))
    assert st == kvplug.Status.STRUCT_SIZE
    with raises(kvplug.StructSizeError, f"struct_size is {size}"):
        _lib.check(st)
    assert out.value is None


# ---- NULL and closed handles --------------------------------------------------------


def test_closed_manager(mgr, unchanged):
    other = kvplug.Manager(4, 4)
    other.close()
    other.close()  # idempotent
    assert other.closed and other.handle is None
    for call in (
        lambda: other.add(1, 1),
        lambda: other.grow([1], 1),
        lambda: other.fork(1, [2]),
        lambda: other.remove([1]),
        lambda: other.describe_into([1], None, None, None),
        lambda: other.stats(),
        lambda: other.check(),
    ):
        with unchanged(), raises(kvplug.InvalidHandleError, "NULL"):
            call()


def test_stale_handle_is_rejected_not_dereferenced(mgr, unchanged):
    other = kvplug.Manager(4, 4)
    stale = other.handle
    other.close()
    check = _lib.fn("kvp_manager_check", ctypes.c_int, [vp])
    with unchanged():
        st = check(stale)
    assert st == kvplug.Status.INVALID_HANDLE and "not live" in _lib.last_error()


def test_foreign_pointer_handle(mgr, unchanged):
    junk = ctypes.c_int64(0)
    add = _lib.fn("kvp_manager_add", ctypes.c_int, [vp, i64, i32])
    with unchanged():
        assert add(ctypes.addressof(junk), 9, 1) == kvplug.Status.INVALID_HANDLE
    assert "not live" in _lib.last_error()


# ---- NULL buffers ----------------------------------------------------------------------


def raw(name, *argtypes):
    return _lib.fn(name, ctypes.c_int, [vp, *argtypes])


def expect_null(st, needle):
    assert st == kvplug.Status.NULL_POINTER, kvplug.Status(st)
    assert needle in _lib.last_error(), _lib.last_error()


def test_grow_null_seq_ids(mgr, unchanged):
    one = ids(1).astype(np.int32)
    with unchanged():
        expect_null(raw("kvp_manager_grow", vp, vp, i32)(mgr.handle, None, one.ctypes.data, 1), "seq_ids")


def test_grow_null_counts(mgr, unchanged):
    with unchanged():
        expect_null(raw("kvp_manager_grow", vp, vp, i32)(mgr.handle, ids(1).ctypes.data, None, 1), "num_tokens")


def test_remove_null_seq_ids(mgr, unchanged):
    with unchanged():
        expect_null(raw("kvp_manager_remove", vp, i32)(mgr.handle, None, 1), "seq_ids")


def fork_raw(m, parent, children, n, copies, max_copies, num):
    return raw("kvp_manager_fork", i64, vp, i32, vp, i32, vp)(m.handle, parent, children, n, copies, max_copies, num)


def test_fork_null_children(mgr, unchanged):
    c, num = BlockCopy(), i32()
    with unchanged():
        expect_null(fork_raw(mgr, 1, None, 1, ctypes.addressof(c), 1, ctypes.addressof(num)), "children")


def test_fork_null_num_copies(mgr, unchanged):
    c = BlockCopy()
    with unchanged():
        expect_null(fork_raw(mgr, 1, ids(9).ctypes.data, 1, ctypes.addressof(c), 1, None), "num_copies")


def test_fork_null_copies_with_capacity(mgr, unchanged):
    num = i32()
    with unchanged():
        expect_null(fork_raw(mgr, 1, ids(9).ctypes.data, 1, None, 1, ctypes.addressof(num)), "copies")


def describe_raw(m, seq_ids, n, num):
    f = raw("kvp_manager_describe", vp, i32, vp, i32, vp, vp, i32, vp)
    return f(m.handle, seq_ids, n, None, 0, None, None, 0, num)


def test_describe_null_seq_ids(mgr, unchanged):
    num = i32()
    with unchanged():
        expect_null(describe_raw(mgr, None, 1, ctypes.addressof(num)), "seq_ids")


def test_describe_null_num_slots(mgr, unchanged):
    with unchanged():
        expect_null(describe_raw(mgr, ids(1).ctypes.data, 1, None), "num_slots")


def test_stats_null_out(mgr, unchanged):
    with unchanged():
        expect_null(raw("kvp_manager_stats_get", vp)(mgr.handle, None), "out")


@pytest.mark.parametrize("size", [0, ctypes.sizeof(ctypes.c_size_t) + 2])
def test_stats_struct_size_too_small(mgr, unchanged, size):
    s = ManagerStatsStruct()
    s.struct_size = size
    with unchanged():
        st = raw("kvp_manager_stats_get", vp)(mgr.handle, ctypes.addressof(s))
    assert st == kvplug.Status.STRUCT_SIZE and "struct_size" in _lib.last_error()
    assert s.num_blocks == 0


def test_stats_older_struct_is_filled_to_its_size(mgr):
    buf = (ctypes.c_ubyte * ctypes.sizeof(ManagerStatsStruct))(*([0xAB] * ctypes.sizeof(ManagerStatsStruct)))
    s = ManagerStatsStruct.from_buffer(buf)
    old = ManagerStatsStruct.free_blocks.offset
    s.struct_size = old
    _lib.check(raw("kvp_manager_stats_get", vp)(mgr.handle, ctypes.addressof(s)))
    assert (s.num_blocks, s.block_size) == (16, 4)
    assert bytes(buf[old:]) == b"\xab" * (len(buf) - old)


# ---- counts: zero, negative, huge ------------------------------------------------------


@pytest.mark.parametrize("n, needle", [(0, "got 0"), (-3, "got -3"), (2**30 + 1, "1073741825")])
def test_add_bad_prompt_len(mgr, unchanged, n, needle):
    with unchanged(), raises(kvplug.InvalidArgumentError, needle):
        mgr.add(9, n)


def test_add_prompt_len_past_int32(mgr, unchanged):
    with unchanged(), raises(kvplug.InvalidArgumentError, "prompt_len must be in"):
        mgr.add(9, 2**40)


def test_grow_empty_batch_does_nothing(mgr, unchanged):
    with unchanged():
        mgr.grow(np.empty(0, np.int64), 1)
    with unchanged(), raises(kvplug.InvalidArgumentError, "2 token counts for 0 sequences"):
        mgr.grow([], [1, 1])


@pytest.mark.parametrize("n, needle", [(0, "got 0"), (-1, "got -1"), (HUGE, "1048577")])
def test_grow_bad_batch_count_raw(mgr, unchanged, n, needle):
    one = np.ones(1, np.int32)
    with unchanged():
        st = raw("kvp_manager_grow", vp, vp, i32)(mgr.handle, ids(1).ctypes.data, one.ctypes.data, n)
    assert st == kvplug.Status.INVALID_ARGUMENT and needle in _lib.last_error()


@pytest.mark.parametrize("count, needle", [(-2, "got -2"), (2**24 + 1, "16777217")])
def test_grow_bad_token_count(mgr, unchanged, count, needle):
    with unchanged(), raises(kvplug.InvalidArgumentError, needle):
        mgr.grow([1, 2, 3], [1, count, 1])
    with unchanged(), raises(kvplug.InvalidArgumentError, needle):
        mgr.grow([1, 2, 3], count)


def test_grow_count_array_length_mismatch(mgr, unchanged):
    with unchanged(), raises(kvplug.InvalidArgumentError, "2 token counts for 3 sequences"):
        mgr.grow([1, 2, 3], [1, 1])


def test_grow_non_integer_ids(mgr, unchanged):
    with unchanged(), raises(kvplug.InvalidArgumentError, "integers"):
        mgr.grow(np.array([1.5, 2.0]), 1)
    with unchanged(), raises(kvplug.InvalidArgumentError, "one-dimensional"):
        mgr.grow(np.ones((2, 2), np.int64), 1)


@pytest.mark.parametrize("n, needle", [(0, "got 0"), (-7, "got -7"), (HUGE, "1048577")])
def test_remove_bad_count_raw(mgr, unchanged, n, needle):
    with unchanged():
        st = raw("kvp_manager_remove", vp, i32)(mgr.handle, ids(1).ctypes.data, n)
    assert st == kvplug.Status.INVALID_ARGUMENT and needle in _lib.last_error()


def test_remove_empty_batch_does_nothing(mgr, unchanged):
    with unchanged():
        mgr.remove([])


@pytest.mark.parametrize("n, needle", [(0, "got 0"), (-1, "got -1"), (HUGE, "1048577")])
def test_fork_bad_count_raw(mgr, unchanged, n, needle):
    c, num = (BlockCopy * 2)(), i32()
    with unchanged():
        st = fork_raw(mgr, 1, ids(9).ctypes.data, n, ctypes.addressof(c), 2, ctypes.addressof(num))
    assert st == kvplug.Status.INVALID_ARGUMENT and needle in _lib.last_error()


def test_fork_negative_max_copies(mgr, unchanged):
    c, num = BlockCopy(), i32()
    with unchanged():
        st = fork_raw(mgr, 1, ids(9).ctypes.data, 1, ctypes.addressof(c), -1, ctypes.addressof(num))
    assert st == kvplug.Status.INVALID_ARGUMENT, _lib.last_error()


def test_fork_no_children(mgr, unchanged):
    with unchanged(), raises(kvplug.InvalidArgumentError, "got 0"):
        mgr.fork(1, [])


@pytest.mark.parametrize("n, needle", [(0, "got 0"), (-2, "got -2"), (HUGE, "1048577")])
def test_describe_bad_count_raw(mgr, unchanged, n, needle):
    num = i32()
    with unchanged():
        st = describe_raw(mgr, ids(1).ctypes.data, n, ctypes.addressof(num))
    assert st == kvplug.Status.INVALID_ARGUMENT and needle in _lib.last_error()


def test_describe_zero_max_blocks_with_table(mgr, unchanged):
    table = np.full(8, 77, np.int32)
    with unchanged(), raises(kvplug.InvalidArgumentError, "got 0"):
        mgr.describe_into([1], table, max_blocks=0)
    assert (table == 77).all()


def test_describe_negative_slot_capacity_raw(mgr, unchanged):
    slots, num = np.zeros(4, np.int32), i32()
    f = raw("kvp_manager_describe", vp, i32, vp, i32, vp, vp, i32, vp)
    with unchanged():
        st = f(mgr.handle, ids(1).ctypes.data, 1, None, 0, None, slots.ctypes.data, -1, ctypes.addressof(num))
    assert st == kvplug.Status.INVALID_ARGUMENT and "got -1" in _lib.last_error()


# ---- unknown and duplicate sequences -----------------------------------------------------


def test_grow_unknown(mgr, unchanged):
    with unchanged(), raises(kvplug.UnknownSequenceError, "sequence 99 is not live"):
        mgr.grow([1, 99], 1)


def test_remove_unknown(mgr, unchanged):
    with unchanged(), raises(kvplug.UnknownSequenceError, "99"):
        mgr.remove([2, 99])


def test_double_remove(mgr, unchanged):
    mgr.remove([3])
    with unchanged([1, 2]), raises(kvplug.UnknownSequenceError, "sequence 3 is not live"):
        mgr.remove([3])


def test_unknown_is_a_key_error(mgr):
    with pytest.raises(KeyError):
        mgr.remove(12345)


def test_describe_unknown(mgr, unchanged):
    lens = np.full(2, 77, np.int32)
    with unchanged(), raises(kvplug.UnknownSequenceError, "99"):
        mgr.describe_into([1, 99], None, lens, None)
    assert (lens == 77).all()


def test_fork_unknown_parent(mgr, unchanged):
    with unchanged(), raises(kvplug.UnknownSequenceError, "parent sequence 99"):
        mgr.fork(99, [9])


def test_add_live_id(mgr, unchanged):
    with unchanged(), raises(kvplug.DuplicateSequenceError, "sequence 2 is already live"):
        mgr.add(2, 4)


def test_grow_repeated_id(mgr, unchanged):
    with unchanged(), raises(kvplug.DuplicateSequenceError, "sequence 1 appears twice"):
        mgr.grow([1, 2, 1], 1)


def test_remove_repeated_id(mgr, unchanged):
    with unchanged(), raises(kvplug.DuplicateSequenceError, "3"):
        mgr.remove([3, 3])


def test_fork_child_live(mgr, unchanged):
    with unchanged(), raises(kvplug.DuplicateSequenceError, "child sequence 2"):
        mgr.fork(1, [9, 2])


def test_fork_child_repeated(mgr, unchanged):
    with unchanged(), raises(kvplug.DuplicateSequenceError, "child sequence 9"):
        mgr.fork(1, [9, 9])


# ---- too few blocks, too small buffers ------------------------------------------------------


def test_add_too_few_blocks(mgr, unchanged):
    with unchanged(), raises(kvplug.OutOfBlocksError, "11 are free"):
        mgr.add(9, 45)


def test_grow_batch_too_few_blocks(mgr, unchanged):
    # each alone fits in the 11 free blocks; together they do not
    with unchanged(), raises(kvplug.OutOfBlocksError, "11 are free"):
        mgr.grow([1, 2, 3], [26, 24, 1])


def test_fork_too_few_blocks(mgr, unchanged):
    mgr.add(4, 40)
    with unchanged([1, 2, 3, 4]), raises(kvplug.OutOfBlocksError, "1 are free"):
        mgr.fork(1, [9, 10])


def test_fork_copies_buffer_too_small_raw(mgr, unchanged):
    c, num = BlockCopy(), i32()
    with unchanged():
        st = fork_raw(mgr, 1, ids(9, 10).ctypes.data, 2, ctypes.addressof(c), 1, ctypes.addressof(num))
    assert st == kvplug.Status.BUFFER_TOO_SMALL and "holds 1" in _lib.last_error()


def test_describe_max_blocks_too_small(mgr, unchanged):
    table = np.full((3, 2), 77, np.int32)
    with unchanged(), raises(kvplug.BufferTooSmallError, "sequence 1 has 3 blocks"):
        mgr.describe_into([1, 2, 3], table)
    assert (table == 77).all()
    with unchanged(), raises(kvplug.BufferTooSmallError, "3 blocks"):
        mgr.describe([1, 2, 3], max_blocks=2)


def test_describe_slots_too_small(mgr, unchanged):
    slots = np.full(14, 77, np.int32)
    with unchanged(), raises(kvplug.BufferTooSmallError, "15 new tokens"):
        mgr.describe_into([1, 2, 3], None, None, slots)
    assert (slots == 77).all()


def test_describe_python_side_buffer_checks(mgr, unchanged):
    # Sizes the C call cannot see are checked before it.
    with unchanged(), raises(kvplug.BufferTooSmallError, "seq_lens holds 2 entries, 3 needed"):
        mgr.describe_into([1, 2, 3], None, np.zeros(2, np.int32))
    with unchanged(), raises(kvplug.BufferTooSmallError, "block_table holds 16 entries, 24 needed"):
        mgr.describe_into([1, 2, 3], np.zeros((2, 8), np.int32))
    with unchanged(), raises(TypeError, "int64"):
        mgr.describe_into([1], np.zeros((1, 8), np.int64))
    with unchanged(), raises(ValueError, "read-only"):
        ro = np.zeros((1, 8), np.int32)
        ro.flags.writeable = False
        mgr.describe_into([1], ro)
    with unchanged(), raises(ValueError, "contiguous"):
        mgr.describe_into([1], None, np.zeros(4, np.int32)[::2])


def test_vcache_destroy_leaves_a_manager_alone():
    # Each destroy checks its handle's type: kvp_vcache_destroy on a
    # kvp_manager * does nothing.
    import ctypes

    from kvplug import _lib

    with kvplug.Manager(8, 4) as m:
        live = _lib.live_handles()
        _lib.fn("kvp_vcache_destroy", None, [ctypes.c_void_p])(m.handle)
        assert _lib.live_handles() == live
        m.add(1, 4)
        m.check()
    assert _lib.live_handles() == live - 1
