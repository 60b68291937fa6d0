"""Tensor dtypes and sizes as the weight-sync manifest names them (no torch import)."""

from __future__ import annotations

from collections.abc import Sequence

_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_size(dtype: str) -> int:
    try:
        return _SIZES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} cannot be synced; allowed: {', '.join(_SIZES)}") from None


def dtype_name(dtype: object) -> str:
    """'torch.float32' -> 'float32'."""
    return str(dtype).removeprefix("torch.")


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
