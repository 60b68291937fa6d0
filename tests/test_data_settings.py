"""spec.data's promptKey and shuffle as PromptSource.from_spec reads them (the driver's prompts)."""

from __future__ import annotations

import json
from pathlib import Path

from kubedistill.api.spec import DistillationJobSpec
from kubedistill.demo.arith import Problem, verl_row
from kubedistill.demo.tiny import char_tokenizer
from kubedistill.runtime.driver.data import PromptSource


def test_prompt_key_names_the_column_and_shuffle_false_keeps_file_order(tmp_path: Path) -> None:
    tok = char_tokenizer("0123456789+=")
    path = tmp_path / "train.jsonl"
    rows = [verl_row(Problem(i, 3 * i % 100), i) for i in range(8)]
    path.write_text("".join(json.dumps({**r, "question": r.pop("prompt")}) + "\n" for r in rows))
    data = {"train": [str(path)], "promptKey": "question", "shuffle": False}
    spec = DistillationJobSpec.model_validate(
        {"student": {"model": "/m"}, "teachers": [{"name": "t", "model": "/t"}], "data": data}
    )
    src = PromptSource.from_spec(spec, tok)
    items = src.take(8)
    assert [i.row for i in items] == list(range(8))
    assert items[3].messages[0]["content"] == "03+09="
    shuffled = PromptSource.from_spec(
        spec.model_copy(update={"data": spec.data.model_copy(update={"shuffle": True})}), tok
    )
    assert [i.row for i in shuffled.take(8)] != list(range(8))
