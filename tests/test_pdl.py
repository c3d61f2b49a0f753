"""The ctypes side of programmatic dependent launch (quant_kernels/pdl.py): argument packing and
the driver structs' layout, which must match cuda.h. No GPU needed."""

import ctypes

import numpy as np
import pytest

from gguf_runtime.quant_kernels import pdl


def test_params_pack_each_argument_at_its_alignment():
    args = (np.int32(-7), np.uint64(0x1122334455667788), np.float32(2.5), np.int32(9), np.float32(-1.0))
    buf, params = pdl._params(args)
    base = ctypes.addressof(buf)
    offsets = [p - base for p in params]
    assert offsets == [0, 8, 16, 20, 24]
    assert ctypes.c_int32.from_address(params[0]).value == -7
    assert ctypes.c_uint64.from_address(params[1]).value == 0x1122334455667788
    assert ctypes.c_float.from_address(params[2]).value == 2.5
    assert ctypes.c_int32.from_address(params[3]).value == 9
    assert ctypes.c_float.from_address(params[4]).value == -1.0


def test_params_refuse_python_objects():
    with pytest.raises(TypeError):
        pdl._params((np.int32(1), "not a scalar"))


def test_driver_struct_layout_matches_cuda_h():
    assert ctypes.sizeof(pdl._Attr) == 72  # CUlaunchAttribute: id, pad to 8, 64-byte union
    assert pdl._Attr.value.offset == 8
    assert pdl._Config.stream.offset == 32  # 7 unsigned ints, then the 8-byte aligned stream
    assert pdl._Config.attrs.offset == 40 and pdl._Config.n_attrs.offset == 48


def test_dims_fill_to_three():
    assert pdl._dims(5) == (5, 1, 1)
    assert pdl._dims((3, np.int64(2))) == (3, 2, 1)
    assert pdl._dims((1, 2, 3)) == (1, 2, 3)
