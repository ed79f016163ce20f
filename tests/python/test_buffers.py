"""Buffers: numpy arrays, buffer-protocol objects and torch tensors are used
in place; wrong element types, strides or read-only outputs are refused."""

from __future__ import annotations

import array
import ctypes

import numpy as np
import pytest

import kvplug
from kvplug import _lib


def test_as_ptr_numpy_is_zero_copy():
    a = np.arange(10, dtype=np.int32)
    assert _lib.as_ptr(a, ctypes.c_int32) == (a.ctypes.data, 10)
    assert _lib.as_ptr(a, None) == (a.ctypes.data, 40)  # any dtype: bytes
    with pytest.raises(TypeError, match="int64"):
        _lib.as_ptr(a, ctypes.c_int64)
    with pytest.raises(ValueError, match="contiguous"):
        _lib.as_ptr(a[::2], ctypes.c_int32)
    with pytest.raises(ValueError, match="12 needed"):
        _lib.as_ptr(a, ctypes.c_int32, min_count=12)
    a.flags.writeable = False
    assert _lib.as_ptr(a, ctypes.c_int32)[1] == 10
    with pytest.raises(ValueError, match="read-only"):
        _lib.as_ptr(a, ctypes.c_int32, writable=True)


def test_as_ptr_buffer_protocol_is_zero_copy():
    arr = array.array("i", [1, 2, 3])
    addr, n = _lib.as_ptr(arr, ctypes.c_int32, writable=True)
    assert (addr, n) == (arr.buffer_info()[0], 3)
    ctypes.c_int32.from_address(addr).value = 42
    assert arr[0] == 42
    mv = memoryview(bytearray(16)).cast("q")
    assert _lib.as_ptr(mv, ctypes.c_int64)[1] == 2
    assert _lib.as_ptr(bytes(8), None)[1] == 8  # read-only input is fine
    with pytest.raises(ValueError, match="read-only"):
        _lib.as_ptr(bytes(8), ctypes.c_uint8, writable=True)
    with pytest.raises(TypeError, match="format 'd'"):
        _lib.as_ptr(array.array("d", [1.0]), ctypes.c_int64)
    with pytest.raises(TypeError, match="expected a numpy array"):
        _lib.as_ptr(object(), ctypes.c_int32)


def test_manager_accepts_buffers(mgr):
    ids = array.array("q", [1, 2, 3])
    mgr.grow(ids, array.array("i", [1, 1, 1]))
    table = array.array("i", [0] * 12)
    lens = memoryview(bytearray(12)).cast("i")
    slots = bytearray(12)
    n = mgr.describe_into(ids, memoryview(table), lens, memoryview(slots).cast("i"), max_blocks=4)
    assert n == 3
    assert lens.tolist() == [11, 5, 2]
    assert table[3] == -1 and table[4 + 2] == -1
    assert np.frombuffer(slots, np.int32)[0] == table[2] * 4 + 2
    with pytest.raises(TypeError, match="format"):
        mgr.describe_into(ids, None, array.array("q", [0, 0, 0]))


def test_manager_rejects_wrong_buffer_element_type(mgr, unchanged):
    with unchanged(), pytest.raises(TypeError):
        mgr.grow(array.array("d", [1.0]), 1)




def _torch():
    return pytest.importorskip("torch")


def test_torch_cpu_tensors(mgr):
    torch = _torch()
    ids = torch.tensor([1, 2, 3], dtype=torch.int64)
    mgr.grow(ids, torch.tensor([1, 1, 1], dtype=torch.int32))
    table = torch.zeros((3, 4), dtype=torch.int32)
    lens = torch.zeros(3, dtype=torch.int32)
    slots = torch.zeros(8, dtype=torch.int32)
    n = mgr.describe_into(ids, table, lens, slots)
    assert n == 3 and lens.tolist() == [11, 5, 2] and table[1, 2].item() == -1
    assert _lib.as_ptr(lens, ctypes.c_int32) == (lens.data_ptr(), 3)
    with pytest.raises(TypeError, match="int64"):
        mgr.describe_into(ids, None, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        mgr.describe_into(ids, None, torch.zeros(6, dtype=torch.int32)[::2])


def test_torch_pinned_tensor(mgr):
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs a CUDA device")
    lens = torch.zeros(3, dtype=torch.int32).pin_memory()
    mgr.describe_into([1, 2, 3], None, lens)
    assert lens.tolist() == [10, 4, 1]
    with pytest.raises(ValueError, match="cuda"):
        mgr.describe_into([1], None, torch.zeros(1, dtype=torch.int32, device="cuda"))


def test_no_torch_import():
    import subprocess
    import sys

    code = (
        "import sys, kvplug, numpy as np, array\n"
        "m = kvplug.Manager(8, 4); m.add(1, 3); m.grow(array.array('q', [1]), 1)\n"
        "m.describe_into([1], np.zeros((1, 2), np.int32), memoryview(bytearray(4)).cast('i'))\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class FakeTensor:
    """What kvplug reads of a torch.Tensor, over a numpy array: exercises the
    tensor path where torch is not installed."""

    __module__ = "torch"

    def __init__(self, arr: np.ndarray, device: str = "cpu") -> None:
        self.arr, self._device = arr, device

    @property
    def device(self):
        import types

        return types.SimpleNamespace(type=self._device.split(":")[0])

    @property
    def dtype(self) -> str:
        return "torch." + {"i4": "int32", "i8": "int64", "f4": "float32"}[self.arr.dtype.str[1:]]

    def data_ptr(self) -> int:
        return self.arr.ctypes.data

    def is_contiguous(self) -> bool:
        return bool(self.arr.flags.c_contiguous)

    def numel(self) -> int:
        return self.arr.size

    def element_size(self) -> int:
        return self.arr.itemsize


def test_tensor_protocol_without_torch(mgr):
    lens = FakeTensor(np.zeros(3, np.int32))
    table = FakeTensor(np.zeros(3 * 4, np.int32))
    ids = FakeTensor(np.array([1, 2, 3], np.int64))
    mgr.describe_into(ids, table, lens, max_blocks=4)
    assert lens.arr.tolist() == [10, 4, 1]
    assert table.arr.reshape(3, 4)[1, 1] == -1
    t = FakeTensor(np.zeros(2, np.float32))
    assert _lib.as_ptr(t, None) == (t.data_ptr(), 8)  # any dtype: bytes
    with pytest.raises(TypeError, match="torch.int64"):
        mgr.describe_into([1], None, FakeTensor(np.zeros(1, np.int64)))
    with pytest.raises(ValueError, match="contiguous"):
        mgr.describe_into([1], None, FakeTensor(np.zeros(4, np.int32)[::2]))
    with pytest.raises(ValueError, match="host buffer"):
        mgr.describe_into([1], None, FakeTensor(np.zeros(1, np.int32), device="cuda:0"))


@pytest.mark.parametrize("form", ["list", "int64", "int32"])
def test_host_i32_copies_converted_values(form):
    """The plan's host arrays (qo_indptr_host, kv_lens_host): a list or an
    int64 array is converted to int32 and copied; the converted copy must
    still be alive when it is read, whatever the allocator does meanwhile."""
    from kvplug import _tensors

    for n in (3, 256, 5000):
        want = list(range(7, 7 + n))
        x = {"list": want, "int64": np.array(want, dtype=np.int64), "int32": np.array(want, dtype=np.int32)}[form]
        for _ in range(20):
            got = _tensors.host_i32(x, n, "kv_lens_host")
            churn = [np.zeros(n, dtype=np.int32) for _ in range(3)]  # reuses freed blocks of this size
            assert list(got) == want, n
            del churn
