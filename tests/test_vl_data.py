"""Image rows in verl's format through PromptSource and the student's processor
(runtime/driver/multimodal.py), the count-the-dots task (kubedistill/demo/dots.py), and datasets
mixing image and text rows."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest

from kubedistill.demo import arith, dots
from kubedistill.demo.tiny_vl import IMAGE_PAD, VISION_END, VISION_START, vl_processor, vl_tokenizer
from kubedistill.runtime.driver.data import PromptSource
from kubedistill.runtime.driver.multimodal import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES_PER_ROW,
    ImageLimits,
    collapse_runs,
    render_images,
    split_markers,
)
from kubedistill.runtime.driver.rewards import RewardRegistry


@pytest.fixture(scope="module")
def proc() -> Any:
    return vl_processor(vl_tokenizer())


def ids_of(proc: Any, *tokens: str) -> list[int]:
    return [proc.tokenizer.convert_tokens_to_ids(t) for t in tokens]


def png(w: int, h: int, color: str = "white") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


# ---- the task ----------------------------------------------------------------------------------
def test_dots_render_with_the_right_count_and_reward() -> None:
    import numpy as np

    one_dot_area = int((np.asarray(dots.Problem(1, 0).image()) < 128).all(-1).sum())
    assert one_dot_area > 50
    for p in dots.problems(40):
        img = p.image()
        assert img.size == (dots.IMAGE_SIZE, dots.IMAGE_SIZE) and img.mode == "RGB"
        dark = int((np.asarray(img) < 128).all(-1).sum())
        assert dark == p.count * one_dot_area, p  # whole, separate dots of one size
        assert p.answer == str(p.count) and p.prompt == "<image>How many dots?"
    assert [p.count for p in dots.problems(8)] == [1, 2, 3, 4, 1, 2, 3, 4]
    assert dots.Problem(3, 5).png() == dots.Problem(3, 5).png()  # deterministic
    assert dots.Problem(3, 5).centers() != dots.Problem(3, 6).centers()
    train, held = dots.split(train=50, held_out=10)
    assert not {p.seed for p in train} & {p.seed for p in held}

    assert dots.reward("3", "3") == dots.reward(" 3\n", "3") == 1.0
    assert dots.reward("4", "3") == dots.reward("33", "3") == dots.reward("3", None) == 0.0
    # The driver's built-in rewards score the task the same way (exact match of synthetic/*).
    registry = RewardRegistry(strict=True, entry_points=False)
    assert registry.score(dots.DATA_SOURCE, " 2", "2") == 1.0 and registry.score(dots.DATA_SOURCE, "1", "2") == 0.0
    assert dots.DATA_SOURCE != arith.DATA_SOURCE


def test_verl_row_format() -> None:
    row = dots.verl_row(dots.Problem(2, 3), 7)
    assert row["data_source"] == dots.DATA_SOURCE
    assert row["prompt"] == [{"role": "user", "content": "<image>How many dots?"}]
    assert row["images"] == [{"bytes": dots.Problem(2, 3).png()}]
    assert row["images"][0]["bytes"].startswith(b"\x89PNG")
    assert row["reward_model"] == {"style": "rule", "ground_truth": "2"} and row["extra_info"] == {"index": 7}


# ---- rendering ---------------------------------------------------------------------------------
def test_markers_become_image_parts() -> None:
    msgs = [{"role": "system", "content": "hi"}, {"role": "user", "content": "<image>a<image> b"}]
    parts, n = split_markers(msgs)
    assert n == 2 and parts[0] == msgs[0]
    assert parts[1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "a"},
        {"type": "image"},
        {"type": "text", "text": " b"},
    ]
    assert split_markers([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}])[1] == 1
    assert collapse_runs([1, 6, 6, 6, 2, 6, 3], 6) == [1, 6, 2, 6, 3]


def test_render_gives_expanded_and_unexpanded_ids(proc) -> None:
    start, pad, end = ids_of(proc, VISION_START, IMAGE_PAD, VISION_END)
    bos = proc.tokenizer.bos_token_id
    question = proc.tokenizer(" and this?", add_special_tokens=False)["input_ids"]
    images = [{"bytes": png(64, 64), "path": None}, base64.b64encode(png(96, 64)).decode()]
    r = render_images([{"role": "user", "content": "<image><image> and this?"}], images, proc, "row 3")
    assert r.text == "<bos>" + (VISION_START + IMAGE_PAD + VISION_END) * 2 + " and this?"
    assert r.engine_prompt_ids == [bos, start, pad, end, start, pad, end, *question]
    assert r.image_grid_thw == [[1, 4, 4], [1, 4, 6]]  # 64x64 -> 4 tokens, 96x64 -> 6
    assert r.prompt_ids == [bos, start, *[pad] * 4, end, start, *[pad] * 6, end, *question]


def test_verl_parquet_rows_are_read_unchanged_and_expanded(tmp_path: Path, proc) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # As verl's Geometry3K preprocessing writes them (HF datasets stores images as {bytes, path}).
    rows = [dots.verl_row(p, i) for i, p in enumerate(dots.problems(3))]
    for r in rows:
        r["images"] = [{"bytes": r["images"][0]["bytes"], "path": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "geo.parquet")
    items = PromptSource([tmp_path / "geo.parquet"], proc.tokenizer, processor=proc, shuffle=False).take(3)
    start, pad, end = ids_of(proc, VISION_START, IMAGE_PAD, VISION_END)
    for item, row in zip(items, rows):
        assert item.images == row["images"]  # passed along unchanged
        assert item.images_base64() == [base64.b64encode(row["images"][0]["bytes"]).decode()]
        assert item.messages == row["prompt"]
        assert item.prompt_ids.count(pad) == 4 and item.prompt_ids[1:7] == [start, pad, pad, pad, pad, end]
        assert item.engine_prompt_ids == collapse_runs(item.prompt_ids, pad)
        assert item.engine_prompt_ids.count(pad) == 1
        assert item.ground_truth == row["reward_model"]["ground_truth"] and item.data_source == dots.DATA_SOURCE


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_mixed_dataset_holds_image_and_text_rows(tmp_path: Path, proc, suffix: str) -> None:
    arith_problems, dots_problems = arith.split()[1][:5], dots.problems(5)
    path = dots.write_mixed(tmp_path / f"mixed{suffix}", arith_problems, dots_problems, seed=0)
    src = PromptSource([path], proc.tokenizer, processor=proc, shuffle=False)
    items = src.take(10)
    by_source: dict[str, list[Any]] = {}
    for item in items:
        by_source.setdefault(item.data_source, []).append(item)
    assert sorted(map(len, by_source.values())) == [5, 5]
    sources = [i.data_source for i in items]
    assert sources not in (sorted(sources), sorted(sources, reverse=True))  # shuffled together
    # Text rows: exactly the tokenizer path, as without a processor.
    plain = {i.row: i for i in PromptSource([path], proc.tokenizer, shuffle=False).take(10)}
    pad = proc.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    for item in by_source[arith.DATA_SOURCE]:
        assert item.engine_prompt_ids is None and item.images is None
        assert item.prompt_ids == plain[item.row].prompt_ids
        assert (
            proc.tokenizer.decode(item.prompt_ids, skip_special_tokens=False) == "<bos>" + item.messages[0]["content"]
        )
    for item in by_source[dots.DATA_SOURCE]:
        assert item.prompt_ids.count(pad) == 4 and item.engine_prompt_ids.count(pad) == 1
    want = sorted(p.answer for p in dots_problems)
    assert sorted(i.ground_truth for i in by_source[dots.DATA_SOURCE]) == want


def test_text_rows_without_a_processor_are_unchanged(tmp_path: Path, proc) -> None:
    path = arith.write_jsonl(arith.split()[1][:4], tmp_path / "t.jsonl")
    with_proc = PromptSource([path], proc.tokenizer, processor=proc, shuffle=False).take(4)
    without = PromptSource([path], proc.tokenizer, shuffle=False).take(4)
    assert [i.prompt_ids for i in with_proc] == [i.prompt_ids for i in without]
    assert all(i.engine_prompt_ids is None for i in with_proc)


# ---- limits and bad rows -----------------------------------------------------------------------
def write_row(tmp_path: Path, images: list[Any], content: str = "<image>How many dots?") -> Path:
    row = {**dots.verl_row(dots.Problem(1, 0), 0), "prompt": [{"role": "user", "content": content}], "images": images}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_defaults_are_sensible() -> None:
    assert (ImageLimits().max_images, ImageLimits().max_pixels, ImageLimits().max_bytes) == (
        MAX_IMAGES_PER_ROW,
        MAX_IMAGE_PIXELS,
        MAX_IMAGE_BYTES,
    )
    assert MAX_IMAGES_PER_ROW >= 1 and MAX_IMAGE_PIXELS >= 1024 * 1024 and MAX_IMAGE_BYTES >= 2**20


@pytest.mark.parametrize(
    "images, content, limits, message",
    [
        ([b64(png(8, 8))] * 3, "<image>" * 3, ImageLimits(max_images=2), r"3 images, more than the limit of 2 per row"),
        ([b64(png(64, 64))], "<image>", ImageLimits(max_bytes=50), r"images\[0\] has more than 50 bytes"),
        (
            [b64(png(64, 65))],
            "<image>",
            ImageLimits(max_pixels=64 * 64),
            r"images\[0\] is 64x65 = 4160 pixels, more than the limit of 4096",
        ),
        (["bm90IGFuIGltYWdl"], "<image>", ImageLimits(), r"images\[0\] is not an image file PIL can read"),
        (["not base64!"], "<image>", ImageLimits(), r"images\[0\] is a string but not base64"),
        ([7], "<image>", ImageLimits(), r"images\[0\] must be bytes, \{bytes: ...\} or a base64 string"),
    ],
)
def test_each_limit_is_refused_naming_the_row(tmp_path: Path, proc, images, content, limits, message) -> None:
    path = write_row(tmp_path, images, content)
    with pytest.raises(ValueError, match=f"rows.jsonl row 0: {message}") as e:
        PromptSource([path], proc.tokenizer, processor=proc, image_limits=limits)  # checked when read
    assert "\n" not in str(e.value)
    rows = [{"role": "user", "content": content}]
    with pytest.raises(ValueError, match=f"row 5: {message}"):
        render_images(rows, images, proc, "row 5", limits)


def test_raw_bytes_limit_and_data_urls(proc) -> None:
    raw = png(64, 64)
    with pytest.raises(
        ValueError, match=rf"row 1: images\[0\] has {len(raw)} bytes, more than the limit of 60 per image"
    ):
        render_images([{"role": "user", "content": "<image>"}], [raw], proc, "row 1", ImageLimits(max_bytes=60))
    r = render_images([{"role": "user", "content": "<image>"}], ["data:image/png;base64," + b64(raw)], proc, "row 1")
    assert r.image_grid_thw == [[1, 4, 4]]


def test_markers_must_match_the_images(tmp_path: Path, proc) -> None:
    path = write_row(tmp_path, [b64(png(64, 64))], content="How many dots?")
    src = PromptSource([path], proc.tokenizer, processor=proc)  # counts are checked when rendered
    with pytest.raises(ValueError, match=r"rows.jsonl row 0: 0 <image> marker\(s\) in the prompt but 1 image\(s\)"):
        src.next()


def test_without_a_processor_images_pass_along_unread(tmp_path: Path, proc) -> None:
    # A text student: the bytes are never decoded (so need not be an image), but count and size hold.
    path = write_row(tmp_path, [b64(b"png")])
    item = PromptSource([path], proc.tokenizer).next()
    assert item.engine_prompt_ids is None and item.images_base64() == [b64(b"png")]
    assert item.prompt_ids == proc.tokenizer("<bos><image>How many dots?", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="row 0: 2 images, more than the limit of 1 per row"):
        PromptSource([write_row(tmp_path, [b64(b"png")] * 2)], proc.tokenizer, image_limits=ImageLimits(max_images=1))
