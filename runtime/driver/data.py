"""PromptSource: training prompts from parquet/jsonl files in verl's data format.

A row holds `prompt` (chat messages: a list of {role, content}; the column is spec.data.promptKey),
`data_source`, optionally `reward_model: {ground_truth, fn?}`, `images` and `extra_info`. Each
prompt is rendered with the student tokenizer's chat template (`add_generation_prompt=True`) and
tokenized; prompts longer than `maxPromptLength` tokens are skipped and counted.

Image rows (verl's multimodal format: `images` of `{bytes}`, raw bytes or base64 strings, and an
`<image>` marker in the prompt text per image) are rendered through the student's processor when
the source has one (runtime/driver/multimodal.py): `prompt_ids` are then the processor-expanded
ids and `engine_prompt_ids` the unexpanded ones vLLM takes with the images. The images' limits
(count, bytes, pixels) are checked for every row when the files are read, so a bad row stops the
job before it starts. Text rows take the tokenizer path whether or not there is a processor.
`maxPromptLength` counts the expanded ids (what the trainer and the teachers see). The driver
loads the processor for a vision-language student only, and refuses image rows for a text one
(runtime/driver/loop.py).

Order: epoch e visits every row once, in a permutation drawn from (spec.data.seed, e) when
shuffling (file order otherwise). The cursor (epoch, position) is the whole state: saving it
and restoring it into a source over the same files continues with exactly the next prompt
(none skipped, none repeated). Prompts handed out but not yet trained on at checkpoint time are
saved by the SampleBuffer, not here.
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kubedistill.runtime.driver.multimodal import DEFAULT_LIMITS, ImageLimits, Processor, check_images, render_images

if TYPE_CHECKING:
    from kubedistill.api.spec import DistillationJobSpec

STATE_FORMAT = 1


class Tokenizer(Protocol):
    """The student's tokenizer (a transformers one), as the driver calls it."""

    def apply_chat_template(
        self, conversation: list[dict[str, Any]], *, add_generation_prompt: bool, tokenize: bool
    ) -> Any: ...
    def __call__(self, text: str, *, add_special_tokens: bool) -> Any: ...
    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str: ...


@dataclass(frozen=True)
class PromptItem:
    """One prompt ready for generation."""

    uid: int
    """Unique across epochs (epoch x rows + position): the GRPO group id of its samples."""
    row: int
    """Index of the row in the concatenated files."""
    epoch: int
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    data_source: str
    route_value: str
    """Value of the routing column (spec.routing.key)."""
    ground_truth: Any = None
    reward_fn: str | None = None
    images: list[Any] | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    engine_prompt_ids: list[int] | None = None
    """Image rows rendered by the student's processor: the prompt with one image pad per image,
    what vLLM takes together with the images (prompt_ids are expanded). None otherwise: then
    prompt_ids serve every consumer."""

    def images_base64(self) -> list[str] | None:
        """The images as plain base64 strings (what /generate and /score take), or None."""
        if not self.images:
            return None
        out = []
        for i, img in enumerate(self.images):
            if isinstance(img, dict):
                img = img.get("bytes")
            if isinstance(img, (bytes, bytearray)):
                out.append(base64.b64encode(img).decode())
            elif isinstance(img, str):  # already base64 in jsonl; a data URL loses its header
                out.append(img.split("base64,", 1)[1] if img.startswith("data:") else img)
            else:
                raise ValueError(f"row {self.row}: images[{i}] must be bytes, {{bytes: ...}} or a base64 string")
        return out


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of one .parquet or .jsonl file as dicts."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"spec.data file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table_rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
        return table_rows
    if suffix in (".jsonl", ".json"):
        rows = []
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{n}: each line must be a JSON object")
                rows.append(row)
        return rows
    raise ValueError(f"spec.data file {path}: unsupported format {suffix!r} (use .parquet or .jsonl)")


def _check_row(row: dict[str, Any], where: str, prompt_key: str, route_key: str) -> None:
    msgs = row.get(prompt_key)
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(
            f"{where}: column {prompt_key!r} (spec.data.promptKey) must be a non-empty list of "
            f"{{role, content}} chat messages, got {type(msgs).__name__}"
        )
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"{where}: {prompt_key}[{i}] must be a {{role, content}} message")
    if not isinstance(row.get("data_source"), str):
        raise ValueError(f"{where}: column 'data_source' must be a string")
    if route_key not in row or row[route_key] is None:
        raise ValueError(f"{where}: routing column {route_key!r} (spec.routing.key) is missing")
    rm = row.get("reward_model")
    if rm is not None and not isinstance(rm, dict):
        raise ValueError(f"{where}: column 'reward_model' must be a mapping with ground_truth")


def _token_ids(encoded: Any) -> list[int]:
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return list(encoded)


class PromptSource:
    """An endless, resumable stream of PromptItems over the training files."""

    def __init__(
        self,
        files: Sequence[str | Path],
        tokenizer: Tokenizer,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 1024,
        shuffle: bool = True,
        seed: int = 0,
        route_key: str = "data_source",
        processor: Processor | None = None,
        image_limits: ImageLimits = DEFAULT_LIMITS,
    ):
        """`processor`: the student's (AutoProcessor) for a vision-language student; without one,
        image rows are tokenized as text and their images passed along unread."""
        if not files:
            raise ValueError("spec.data.train: no files")
        self.tokenizer = tokenizer
        self.processor = processor
        self.image_limits = image_limits
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.shuffle = shuffle
        self.seed = seed
        self.route_key = route_key
        self.rows: list[dict[str, Any]] = []
        self._where: list[str] = []
        for f in files:
            for i, row in enumerate(read_rows(Path(f))):
                where = f"{f} row {i}"
                _check_row(row, where, prompt_key, route_key)
                if row.get("images"):
                    check_images(row["images"], where, image_limits, pixels=processor is not None)
                self.rows.append(row)
                self._where.append(where)
        if not self.rows:
            raise ValueError(f"spec.data.train: the files {list(map(str, files))} hold no rows")
        self.epoch = 0
        self.position = 0
        self.dropped = 0
        """Prompts skipped for exceeding maxPromptLength (every time one is met)."""
        self._order: list[int] | None = None
        self._too_long: set[int] = set()

    @classmethod
    def from_spec(
        cls, spec: DistillationJobSpec, tokenizer: Tokenizer, split: str = "train", processor: Processor | None = None
    ) -> PromptSource:
        """The source of spec.data.train, or of spec.data.val (never shuffled) with split="val"."""
        d = spec.data
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        files = d.train if split == "train" else d.val
        if not files:
            raise ValueError(f"spec.data.{split}: no files")
        return cls(
            files,
            tokenizer,
            prompt_key=d.prompt_key,
            max_prompt_length=d.max_prompt_length,
            shuffle=d.shuffle and split == "train",
            seed=d.seed,
            route_key=spec.routing.key,
            processor=processor,
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[PromptItem]:
        return self

    def __next__(self) -> PromptItem:
        return self.next()

    def order(self, epoch: int) -> list[int]:
        """Row indices in the order epoch `epoch` visits them."""
        idx = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"kubedistill-data:{self.seed}:{epoch}").shuffle(idx)
        return idx

    def tokenize(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template already wrote any BOS/special tokens into the text.
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.truncation is None and backend.padding is None:
            # A fast tokenizer's own encoder: the same ids without transformers' wrapping of
            # each call, a cost on the driver's event loop (docs/design.md, "Compared with peers").
            return list(backend.encode(text, add_special_tokens=False).ids)
        return _token_ids(self.tokenizer(text, add_special_tokens=False))

    def next(self) -> PromptItem:
        skipped_in_a_row = 0
        while True:
            if self.position >= len(self.rows):
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
            if self._order is None:
                self._order = self.order(self.epoch)
            pos = self.position
            r = self._order[pos]
            self.position += 1
            item = None if r in self._too_long else self._item(r, pos)
            if item is not None:
                return item
            self.dropped += 1
            skipped_in_a_row += 1
            if skipped_in_a_row >= len(self.rows):
                raise ValueError(
                    f"every prompt is longer than spec.data.maxPromptLength ({self.max_prompt_length} tokens)"
                )

    def take(self, count: int) -> list[PromptItem]:
        return [self.next() for _ in range(count)]

    def first_items(self, limit: int | None = None) -> list[PromptItem]:
        """The first `limit` rows (all when None) that fit maxPromptLength, each once, in the
        epoch-0 order; the cursor is left alone (the held-out set of every evaluation)."""
        out: list[PromptItem] = []
        for pos, r in enumerate(self.order(0)):
            if limit is not None and len(out) >= limit:
                break
            item = self._item(r, pos)
            if item is not None:
                out.append(item)
        return out

    def image_rows(self) -> Iterator[tuple[str, str, str]]:
        """(where, data_source, routing-key value) of every row with images, in file order: what
        the driver checks against the student and the teachers before the run starts."""
        for where, row in zip(self._where, self.rows):
            if row.get("images"):
                yield where, str(row["data_source"]), str(row[self.route_key])

    def _item(self, r: int, pos: int) -> PromptItem | None:
        row = self.rows[r]
        messages = row[self.prompt_key]
        engine_ids = None
        if self.processor is not None and row.get("images"):
            rendered = render_images(messages, row["images"], self.processor, self._where[r], self.image_limits)
            ids, engine_ids = rendered.prompt_ids, rendered.engine_prompt_ids
        else:
            ids = self.tokenize(messages)
        if len(ids) > self.max_prompt_length:
            self._too_long.add(r)
            return None
        rm = row.get("reward_model") or {}
        return PromptItem(
            uid=self.epoch * len(self.rows) + pos,
            row=r,
            epoch=self.epoch,
            prompt_ids=ids,
            messages=messages,
            data_source=row["data_source"],
            route_value=str(row[self.route_key]),
            ground_truth=rm.get("ground_truth"),
            reward_fn=rm.get("fn"),
            images=row.get("images"),
            extra_info=row.get("extra_info") or {},
            engine_prompt_ids=engine_ids,
        )

    # ---- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "epoch": self.epoch,
            "position": self.position,
            "rows": len(self.rows),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dropped": self.dropped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"data cursor format {state.get('format')!r} is not {STATE_FORMAT}")
        for key, mine in (("rows", len(self.rows)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state[key] != mine:
                raise ValueError(
                    f"checkpointed data cursor has {key}={state[key]!r} but spec.data gives {mine!r}; "
                    "the training data changed since the checkpoint"
                )
        if not 0 <= int(state["position"]) <= len(self.rows) or int(state["epoch"]) < 0:
            raise ValueError(f"checkpointed data cursor is out of range: {state}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.dropped = int(state.get("dropped", 0))
        self._order = None
