"""PromptSource: verl-format parquet/jsonl, chat template, length filter, resumable cursor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubedistill.demo.arith import Problem, verl_row, write_jsonl
from kubedistill.demo.tiny import char_tokenizer
from kubedistill.runtime.driver.data import PromptSource


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer("0123456789+=")


def problems(count: int) -> list[Problem]:
    return [Problem(i, (7 * i) % 100) for i in range(count)]


def test_jsonl_rows_become_templated_prompts(tmp_path: Path, tok) -> None:
    path = write_jsonl(problems(3), tmp_path / "train.jsonl")
    src = PromptSource([path], tok, shuffle=False)
    item = src.next()
    assert item.prompt_ids == tok("<bos>00+00=", add_special_tokens=False)["input_ids"]
    assert item.prompt_ids[0] == tok.bos_token_id
    assert (item.uid, item.row, item.data_source, item.route_value, item.ground_truth) == (0, 0, "arith", "arith", "0")
    assert item.messages == [{"role": "user", "content": "00+00="}]


def test_parquet_with_prompt_key_and_images(tmp_path: Path, tok) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [verl_row(p, i) for i, p in enumerate(problems(4))]
    for r in rows:
        r["question"] = r.pop("prompt")
        r["images"] = [{"bytes": b"png", "path": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    src = PromptSource([tmp_path / "train.parquet"], tok, prompt_key="question", shuffle=False)
    items = src.take(4)
    assert [i.ground_truth for i in items] == [p.answer for p in problems(4)]
    assert items[0].images_base64() == ["cG5n"]


def test_long_prompts_are_dropped_and_counted(tmp_path: Path, tok) -> None:
    path = tmp_path / "mixed.jsonl"
    write_jsonl(problems(2), path)
    with path.open("a") as f:
        f.write(json.dumps({**verl_row(Problem(1, 1), 9), "prompt": [{"role": "user", "content": "1" * 40}]}) + "\n")
    src = PromptSource([path], tok, max_prompt_length=8, shuffle=False)
    got = [src.next().row for _ in range(5)]
    assert got == [0, 1, 0, 1, 0]  # row 2 (41 tokens) skipped in both epochs
    assert src.dropped == 2

    only_long = tmp_path / "long.jsonl"
    only_long.write_text(
        json.dumps({**verl_row(Problem(1, 1), 0), "prompt": [{"role": "user", "content": "9" * 20}]}) + "\n"
    )
    with pytest.raises(ValueError, match="maxPromptLength"):
        PromptSource([only_long], tok, max_prompt_length=8).next()


def test_epochs_are_permutations_shuffled_per_epoch_by_seed(tmp_path: Path, tok) -> None:
    path = write_jsonl(problems(20), tmp_path / "t.jsonl")
    src = PromptSource([path], tok, seed=3)
    e0 = [src.next().row for _ in range(20)]
    e1 = [src.next().row for _ in range(20)]
    assert sorted(e0) == sorted(e1) == list(range(20))
    assert e0 != e1 and e0 != list(range(20))
    assert e0 == PromptSource([path], tok, seed=3).order(0)
    assert e0 != PromptSource([path], tok, seed=4).order(0)


def test_cursor_restore_neither_skips_nor_repeats(tmp_path: Path, tok) -> None:
    a = write_jsonl(problems(5), tmp_path / "a.jsonl")
    b = write_jsonl(problems(8)[5:], tmp_path / "b.jsonl")
    straight = PromptSource([a, b], tok, seed=11)
    reference = [(i.uid, i.row) for i in straight.take(21)]  # 2 epochs of 8 + 5

    first = PromptSource([a, b], tok, seed=11)
    head = [(i.uid, i.row) for i in first.take(10)]
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    second = PromptSource([a, b], tok, seed=11)
    second.load_state_dict(state)
    tail = [(i.uid, i.row) for i in second.take(11)]
    assert head + tail == reference
    assert len({uid for uid, _ in reference}) == 21  # group ids never repeat across epochs

    changed = PromptSource([a], tok, seed=11)
    with pytest.raises(ValueError, match="rows=8 but spec.data gives 5"):
        changed.load_state_dict(state)


def test_bad_rows_and_files_get_one_line_errors(tmp_path: Path, tok) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "just text", "data_source": "arith"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl row 0: column 'prompt' .* list of \{role, content\}"):
        PromptSource([bad], tok)
    bad.write_text(json.dumps({"prompt": [{"role": "user", "content": "1"}]}) + "\n")
    with pytest.raises(ValueError, match="'data_source' must be a string"):
        PromptSource([bad], tok)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not valid JSON"):
        PromptSource([bad], tok)
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ValueError, match="unsupported format '.csv'"):
        PromptSource([tmp_path / "x.csv"], tok)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PromptSource([tmp_path / "missing.jsonl"], tok)


def test_from_spec_reads_train_and_val(tmp_path: Path, tok) -> None:
    from kubedistill.api.spec import DistillationJobSpec

    train = write_jsonl(problems(6), tmp_path / "train.jsonl")
    val = write_jsonl(problems(3), tmp_path / "val.jsonl")
    spec = DistillationJobSpec.model_validate(
        {
            "student": {"model": "/m"},
            "teachers": [{"name": "t", "model": "/t"}],
            "data": {"train": [str(train)], "val": [str(val)], "maxPromptLength": 16, "seed": 5},
        }
    )
    src = PromptSource.from_spec(spec, tok)
    assert (len(src), src.seed, src.max_prompt_length, src.shuffle) == (6, 5, 16, True)
    v = PromptSource.from_spec(spec, tok, split="val")
    assert len(v) == 3 and not v.shuffle and [i.row for i in v.take(3)] == [0, 1, 2]


def test_prompts_get_the_tokenizers_own_ids_truncation_set_or_not(tmp_path: Path) -> None:
    # The fast path (the Rust encoder, straight) must give what tokenizer(text) gives; a backend
    # left with truncation on goes through tokenizer(), which does not truncate.
    tok = char_tokenizer("0123456789+=")
    path = write_jsonl(problems(20), tmp_path / "train.jsonl")
    src = PromptSource([path], tok, shuffle=False)
    for item in src.take(20):
        text = tok.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=False)
        assert item.prompt_ids == tok(text, add_special_tokens=False)["input_ids"]
    tok.backend_tokenizer.enable_truncation(3)
    item = PromptSource([path], tok, shuffle=False).next()
    assert len(item.prompt_ids) > 3 and item.prompt_ids == src.first_items(1)[0].prompt_ids
