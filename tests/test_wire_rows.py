"""Rows: per-token rows of numbers as one binary array on the wire (runtime/wire/rows.py)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from pydantic import ValidationError

from kubedistill.runtime.wire.protocol import ScoreRequest, ScoreResponse
from kubedistill.runtime.wire.rows import Rows
from kubedistill.runtime.wire.streams import ScoreBatch


def test_rows_decode_to_a_view_of_their_bytes_in_either_validation_mode() -> None:
    ids = np.arange(12, dtype=np.int32).reshape(3, 4) * 40_000  # ids past 16 bits
    req = ScoreRequest(token_ids=[1, 2, 3, 4, 5], prompt_len=2, gather_ids=Rows.of(ids, "int32"))
    text = ScoreBatch(requests=[req]).model_dump_json()
    # JSON text (the driver's answers: pydantic decodes the base64 in Rust), and a body FastAPI has
    # already parsed into Python objects (a server's requests: the base64 is still text).
    for got in (ScoreBatch.model_validate_json(text), ScoreBatch.model_validate(json.loads(text))):
        rows = got.requests[0].gather_ids
        assert rows is not None and isinstance(rows.data, bytes)
        a = rows.array()
        assert a.dtype == np.dtype("<i4") and a.shape == (3, 4) and not a.flags.writeable
        assert np.array_equal(a, ids)


def test_rows_read_both_base64_alphabets_and_any_client_can_decode_them() -> None:
    values = np.array([[-0.5, 1e-3], [np.float32(-7.25), -np.inf]], dtype=np.float32)
    raw = values.astype("<f4").tobytes()
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        doc = {"dtype": "float32", "shape": [2, 2], "data": encode(raw).decode()}
        assert np.array_equal(Rows.model_validate_json(json.dumps(doc)).array(), values)
        assert np.array_equal(Rows.model_validate(doc).array(), values)
    # What servers.md tells a client in another language to do.
    sent = json.loads(Rows.of(values, "float32").model_dump_json())
    decoded = np.frombuffer(base64.urlsafe_b64decode(sent["data"]), "<f4").reshape(sent["shape"])
    assert np.array_equal(decoded, values)


def test_ragged_rows_keep_their_lengths() -> None:
    rows = Rows.of([[5, 6, 7], [8], [9, 10]], "int32")
    assert rows.shape == (3, 3) and rows.lengths == [3, 1, 2] and not rows.full
    assert rows.array().tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert rows.tolist() == [[5, 6, 7], [8], [9, 10]]
    assert Rows.of([[1, 2]] * 2, "int32").full and Rows.of([], "int32").shape == (0, 0)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"dtype": "int32", "shape": [2, 2], "data": "AAAA"}, "data: 3 bytes, a int32 \\[2, 2\\] array has 16"),
        ({"dtype": "int64", "shape": [1, 1], "data": "AAAAAAAAAAA="}, "dtype"),
        ({"dtype": "int32", "shape": [1, 1], "data": "AAAAAA==", "lengths": [2]}, "longer than the width 1"),
        ({"dtype": "int32", "shape": [2, 1], "data": "AAAAAAAAAAA=", "lengths": [1]}, "1 entries for 2 rows"),
        ({"dtype": "int32", "shape": [1, 1], "data": "!!!!"}, "base64"),
    ],
)
def test_malformed_rows_are_refused_naming_the_field(doc: dict[str, object], message: str) -> None:
    for validate in (Rows.model_validate, lambda d: Rows.model_validate_json(json.dumps(d))):
        with pytest.raises(ValidationError, match=message):
            validate(doc)


def test_a_score_answer_is_under_half_its_json_lists() -> None:
    rng = np.random.default_rng(0)
    ids, lps = rng.integers(0, 150_000, (1500, 64)), -rng.exponential(2.0, (1500, 64)).astype(np.float32)
    answer = ScoreResponse(
        logprobs=[-0.5] * 1500, topk_ids=Rows.of(ids, "int32"), topk_logprobs=Rows.of(lps, "float32")
    )
    lists = json.dumps({"topk_ids": ids.tolist(), "topk_logprobs": lps.astype(float).tolist()})
    assert len(answer.model_dump_json()) < 0.5 * len(lists)
