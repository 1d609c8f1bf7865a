"""The closed set of tensor dtypes (docs/format.md section 4.1)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DType:
    """One storable dtype: its name in the manifest, element size, and names in numpy and safetensors."""

    name: str
    itemsize: int
    numpy: str | None
    safetensors: str | None


_TABLE = (
    DType("float64", 8, "float64", "F64"),
    DType("float32", 4, "float32", "F32"),
    DType("float16", 2, "float16", "F16"),
    DType("bfloat16", 2, None, "BF16"),
    DType("float8_e4m3fn", 1, None, "F8_E4M3"),
    DType("float8_e5m2", 1, None, "F8_E5M2"),
    DType("float8_e4m3fnuz", 1, None, None),
    DType("float8_e5m2fnuz", 1, None, None),
    DType("float8_e8m0fnu", 1, None, None),
    DType("float4_e2m1fn_x2", 1, None, None),
    DType("complex128", 16, "complex128", None),
    DType("complex64", 8, "complex64", None),
    DType("complex32", 4, None, None),
    DType("int64", 8, "int64", "I64"),
    DType("int32", 4, "int32", "I32"),
    DType("int16", 2, "int16", "I16"),
    DType("int8", 1, "int8", "I8"),
    DType("uint64", 8, "uint64", "U64"),
    DType("uint32", 4, "uint32", "U32"),
    DType("uint16", 2, "uint16", "U16"),
    DType("uint8", 1, "uint8", "U8"),
    DType("bool", 1, "bool", "BOOL"),
    DType("bits16", 2, None, None),
    DType("bits8", 1, None, None),
    DType("bits1x8", 1, None, None),
    DType("bits2x4", 1, None, None),
    DType("bits4x2", 1, None, None),
    *(DType(f"int{i}", 1, None, None) for i in range(1, 8)),
    *(DType(f"uint{i}", 1, None, None) for i in range(1, 8)),
)

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}

# numpy dtype name -> our name, for numpy arrays in the state tree.
NUMPY_TO_NAME: dict[str, str] = {d.numpy: d.name for d in _TABLE if d.numpy is not None}


def lookup(name: str) -> DType | None:
    """Return the dtype called ``name``, or None when it is not in the closed set."""
    return DTYPES.get(name)


def raw_numpy_name(dtype: DType) -> str:
    """The numpy dtype that holds ``dtype``'s bytes: its own, or an unsigned int of the same width."""
    if dtype.numpy is not None:
        return dtype.numpy
    return {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64", 16: "complex128"}[dtype.itemsize]
