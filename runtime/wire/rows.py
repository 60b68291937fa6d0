"""Per-token rows of numbers (a teacher's top-k ids and log-probs) as one binary array on the wire.

At top-64 a scored token brings 128 numbers. As JSON lists each becomes a Python object in the
driver: ~10 ms of parsing per 1.5k-token answer and ~10 MB of heap while the sample is held
(docs/design.md#at-scale). `Rows` carries the same rows as the raw little-endian bytes of one
[rows, width] array, base64 in the JSON body (pydantic encodes and decodes it in Rust), and
`array()` is a numpy view of those bytes: nothing per number. Rows shorter than `width` (a
vocabulary smaller than top-k, a multi-turn trace's one-id rows) are zero-padded, and `lengths`
says how many entries each row holds.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

RowsDtype = Literal["int32", "float32"]
_NUMPY: dict[str, np.dtype[Any]] = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4")}
_URL_SAFE = str.maketrans("-_", "+/")


def _from_base64(text: str) -> bytes:
    try:
        return base64.b64decode(text.translate(_URL_SAFE), validate=True)
    except binascii.Error as e:
        raise ValueError(f"not base64: {e}") from None


class Rows(BaseModel):
    """`shape[0]` rows of at most `shape[1]` numbers: `data` holds the [rows, width] array of
    `dtype`, little-endian, row after row (base64 in JSON, standard or URL-safe alphabet)."""

    model_config = ConfigDict(extra="forbid", strict=True, ser_json_bytes="base64", val_json_bytes="base64")

    dtype: RowsDtype
    shape: Annotated[tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]], Field(strict=False)]
    """[rows, width]; not strict, so that a JSON list validates as the tuple in either mode."""
    data: Annotated[bytes | Annotated[str, AfterValidator(_from_base64)], Field(union_mode="left_to_right")]
    """JSON text is decoded by pydantic (val_json_bytes, in Rust); a body already parsed into Python
    objects (FastAPI validates request bodies that way) holds the base64 text, decoded here."""
    lengths: list[Annotated[int, Field(ge=0)]] | None = None
    """Entries per row when some rows are shorter than shape[1] (the rest is padding); None: all full."""

    @model_validator(mode="after")
    def _data_fills_the_shape(self) -> Rows:
        rows, width = self.shape
        expected = rows * width * _NUMPY[self.dtype].itemsize
        if len(self.data) != expected:
            raise ValueError(f"data: {len(self.data)} bytes, a {self.dtype} [{rows}, {width}] array has {expected}")
        if self.lengths is not None:
            if len(self.lengths) != rows:
                raise ValueError(f"lengths: {len(self.lengths)} entries for {rows} rows")
            if any(n > width for n in self.lengths):
                raise ValueError(f"lengths: a row longer than the width {width}")
        return self

    @property
    def full(self) -> bool:
        """Every row holds `shape[1]` entries."""
        return self.lengths is None or all(n == self.shape[1] for n in self.lengths)

    def array(self) -> np.ndarray:
        """The [rows, width] array: a read-only view of `data`, padding included."""
        a: np.ndarray = np.frombuffer(self.data, _NUMPY[self.dtype]).reshape(self.shape)
        return a

    def tolist(self) -> list[list[Any]]:
        """The rows as lists, each as long as its length."""
        rows: list[list[Any]] = self.array().tolist()
        if self.lengths is None:
            return rows
        return [row[:n] for row, n in zip(rows, self.lengths)]

    @classmethod
    def of(
        cls, rows: np.ndarray | Sequence[Sequence[float]], dtype: RowsDtype, lengths: list[int] | None = None
    ) -> Rows:
        """Rows of an array (anything numpy takes: a tensor moved to the CPU, a list of equal
        rows; `lengths` when its rows are padded) or of ragged lists, whose short rows are padded
        and their lengths kept."""
        if isinstance(rows, np.ndarray) or _equal_rows(rows):
            a = np.ascontiguousarray(rows, dtype=_NUMPY[dtype])
            if a.ndim != 2:  # no rows at all
                a = a.reshape(len(a), 0)
            return cls(dtype=dtype, shape=(a.shape[0], a.shape[1]), data=a.tobytes(), lengths=lengths)
        lengths = [len(row) for row in rows]
        padded = np.zeros((len(rows), max(lengths, default=0)), dtype=_NUMPY[dtype])
        for i, row in enumerate(rows):
            padded[i, : len(row)] = row
        return cls(dtype=dtype, shape=(padded.shape[0], padded.shape[1]), data=padded.tobytes(), lengths=lengths)


def _equal_rows(rows: Sequence[Sequence[float]]) -> bool:
    return len({len(row) for row in rows}) <= 1


def row_lengths(rows: Rows | np.ndarray | Sequence[Sequence[Any]]) -> np.ndarray:
    """Entries in each row (int64): every row of a 2-D array is full; a Rows' `lengths` say."""
    if isinstance(rows, Rows):
        if rows.lengths is not None:
            given: np.ndarray = np.asarray(rows.lengths, np.int64)
            return given
        rows = rows.array()
    if isinstance(rows, np.ndarray) and rows.ndim == 2:
        full: np.ndarray = np.full(len(rows), rows.shape[1], np.int64)
        return full
    lengths: np.ndarray = np.fromiter(map(len, rows), np.int64, len(rows))
    return lengths
