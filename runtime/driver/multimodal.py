"""Image rows -> the prompt ids of a vision-language student (pure functions, no model).

A row in verl's multimodal format holds an `images` column (each image `{bytes: ...}`, raw bytes,
or a base64 string, possibly a data URL) and `<image>` markers in its prompt text, one per image
in order, as verl's Geometry3K preprocessing writes them. :func:`render_images` splits each
marked message into `{type: image}` / `{type: text}` parts, renders them with the student
processor's chat template (one `<|vision_start|><|image_pad|><|vision_end|>` per image for a
Qwen-VL) and returns both id lists the rest of the job needs:

- `prompt_ids`: expanded by the processor (each image's pad repeated once per merged patch); what
  the trainer and a vision teacher score together with the processor's `pixel_values`;
- `engine_prompt_ids`: unexpanded, one image pad per image; what vLLM takes with
  `multi_modal_data` (it expands them itself, and would expand already-expanded ids again).

Limits (ImageLimits; defaults are this module's constants): images per row, bytes of each image
file after base64 decoding, and pixels of each image (read from its header, before decoding the
pixels). Each breach is a one-line ValueError naming the row.

Which models read images: a model directory whose `config.json` has a `vision_config`
(:func:`reads_images`), the same test the trainer uses to build the model
(runtime/models/loading.py `is_vision_language`), read as plain JSON so a text job imports and
loads nothing more. :func:`load_student_processor` loads the student's AutoProcessor only for
such a student, and requires it to have an image processor; the driver uses :func:`reads_images`
on the teachers too, to refuse image rows routed to a text teacher before the run starts
(runtime/driver/routing.py).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from PIL.Image import Image

    from kubedistill.api.spec import DistillationJobSpec

IMAGE_MARKER = "<image>"
MAX_IMAGES_PER_ROW = 8
MAX_IMAGE_PIXELS = 4096 * 4096
"""Width x height of one image (a decompression-bomb guard; the processor resizes it anyway)."""
MAX_IMAGE_BYTES = 16 * 2**20
"""Bytes of one image file, after base64 decoding."""


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = MAX_IMAGES_PER_ROW
    max_pixels: int = MAX_IMAGE_PIXELS
    max_bytes: int = MAX_IMAGE_BYTES


DEFAULT_LIMITS = ImageLimits()


class Processor(Protocol):
    """A transformers multimodal processor (AutoProcessor), as the driver calls it."""

    tokenizer: Any

    def apply_chat_template(
        self, conversation: list[dict[str, Any]], *, add_generation_prompt: bool, tokenize: bool
    ) -> Any: ...
    def __call__(self, *, text: list[str], images: list[Any], return_tensors: str, add_special_tokens: bool) -> Any: ...


@dataclass(frozen=True)
class RenderedImages:
    """An image row's prompt, rendered for a vision-language student."""

    prompt_ids: list[int]
    """Processor-expanded ids (trainer, vision teacher)."""
    engine_prompt_ids: list[int]
    """One image pad per image (vLLM, with the images as multi_modal_data)."""
    image_grid_thw: list[list[int]]
    """The processor's (t, h, w) patch grid of each image."""
    text: str
    """The rendered prompt text, image pads unexpanded."""


def image_bytes(images: Any, where: str, limits: ImageLimits = DEFAULT_LIMITS) -> list[bytes]:
    """The raw file bytes of a row's images, checking their count and size."""
    if not isinstance(images, (list, tuple)):
        raise ValueError(f"{where}: column 'images' must be a list, got {type(images).__name__}")
    if len(images) > limits.max_images:
        raise ValueError(f"{where}: {len(images)} images, more than the limit of {limits.max_images} per row")
    out = []
    for i, img in enumerate(images):
        if isinstance(img, dict):
            img = img.get("bytes")
        if isinstance(img, (bytes, bytearray)):
            raw = bytes(img)
        elif isinstance(img, str):
            b64 = img.split("base64,", 1)[1] if img.startswith("data:") else img
            if len(b64) * 3 // 4 > limits.max_bytes + 3:  # refuse before decoding
                raise ValueError(f"{where}: images[{i}] has more than {limits.max_bytes} bytes (the per-image limit)")
            try:
                raw = base64.b64decode(b64, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"{where}: images[{i}] is a string but not base64") from None
        else:
            raise ValueError(f"{where}: images[{i}] must be bytes, {{bytes: ...}} or a base64 string")
        if len(raw) > limits.max_bytes:
            raise ValueError(
                f"{where}: images[{i}] has {len(raw)} bytes, more than the limit of {limits.max_bytes} per image"
            )
        out.append(raw)
    return out


def _open_header(raw: bytes, i: int, where: str, limits: ImageLimits) -> Image:
    """The image with only its header read, checked against the pixel limit."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError:
        raise ValueError(f"{where}: images[{i}] has more pixels than PIL will decode") from None
    except (UnidentifiedImageError, OSError):
        raise ValueError(f"{where}: images[{i}] is not an image file PIL can read") from None
    w, h = img.size
    if w * h > limits.max_pixels:
        raise ValueError(
            f"{where}: images[{i}] is {w}x{h} = {w * h} pixels, more than the limit of {limits.max_pixels}"
        )
    return img


def check_images(images: Any, where: str, limits: ImageLimits = DEFAULT_LIMITS, *, pixels: bool = True) -> None:
    """Every limit on a row's images without decoding their pixels (`pixels`: read each header
    for its size; off for rows that are never decoded, where the bytes need not be an image)."""
    raws = image_bytes(images, where, limits)
    if pixels:
        for i, raw in enumerate(raws):
            _open_header(raw, i, where, limits)


def open_images(raws: Sequence[bytes], where: str, limits: ImageLimits = DEFAULT_LIMITS) -> list[Image]:
    """Decoded RGB images, each checked against the pixel limit before its pixels are decoded."""
    from PIL import Image

    out = []
    for i, raw in enumerate(raws):
        img = _open_header(raw, i, where, limits)
        try:
            img.load()
        except (OSError, Image.DecompressionBombError) as e:  # truncated or corrupt
            raise ValueError(f"{where}: images[{i}] cannot be decoded ({type(e).__name__})") from None
        out.append(img.convert("RGB"))
    return out


def split_markers(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Messages with each `<image>` marker turned into an image part (verl's convention), and
    the number of image parts. Messages whose content is already a list of parts are kept."""
    out, count = [], 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            if IMAGE_MARKER not in content:
                out.append(dict(m))
                continue
            parts: list[dict[str, Any]] = []
            for piece in re.split(f"({re.escape(IMAGE_MARKER)})", content):
                if piece == IMAGE_MARKER:
                    parts.append({"type": "image"})
                    count += 1
                elif piece:
                    parts.append({"type": "text", "text": piece})
            out.append({**m, "content": parts})
        else:
            count += sum(1 for p in content or [] if isinstance(p, dict) and p.get("type") == "image")
            out.append(dict(m))
    return out, count


def image_token_id(processor: Processor) -> int:
    token_id = getattr(processor, "image_token_id", None)
    if token_id is None:
        token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)  # type: ignore[attr-defined]
    return int(token_id)


def collapse_runs(ids: Sequence[int], token: int) -> list[int]:
    """`ids` with every run of `token` shortened to one: expanded ids -> unexpanded."""
    return [t for i, t in enumerate(ids) if t != token or i == 0 or ids[i - 1] != token]


def render_images(
    messages: Sequence[dict[str, Any]],
    images: Any,
    processor: Processor,
    where: str,
    limits: ImageLimits = DEFAULT_LIMITS,
) -> RenderedImages:
    """Render an image row through the student's processor (see the module docstring)."""
    decoded = open_images(image_bytes(images, where, limits), where, limits)
    parts, markers = split_markers(messages)
    if markers != len(decoded):
        raise ValueError(
            f"{where}: {markers} {IMAGE_MARKER} marker(s) in the prompt but {len(decoded)} image(s); "
            f"put one {IMAGE_MARKER} in the prompt text where each image goes"
        )
    text: str = processor.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
    pad = image_token_id(processor)
    # The template already wrote any BOS/special tokens into the text.
    engine_ids = [int(t) for t in processor.tokenizer(text, add_special_tokens=False)["input_ids"]]
    if engine_ids.count(pad) != len(decoded):
        raise ValueError(
            f"{where}: the student's chat template wrote {engine_ids.count(pad)} image placeholder(s) "
            f"for {len(decoded)} image(s)"
        )
    enc = processor(text=[text], images=decoded, return_tensors="pt", add_special_tokens=False)
    expanded = [int(t) for t in enc["input_ids"][0].tolist()]
    grid = [[int(x) for x in row] for row in enc["image_grid_thw"].tolist()]
    if collapse_runs(expanded, pad) != engine_ids:  # the processor only repeats each pad
        raise ValueError(f"{where}: the processor's expanded prompt does not match its template's text")
    return RenderedImages(prompt_ids=expanded, engine_prompt_ids=engine_ids, image_grid_thw=grid, text=text)


# ---- which models read images -----------------------------------------------------------------
def reads_images(model_dir: str | Path) -> bool | None:
    """Whether the HF model in `model_dir` is a vision-language model: its config.json has a
    `vision_config` (Qwen-VL, LLaVA, Gemma 3 and the like). None when there is no config.json to
    read (a path this process cannot see): unknown."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return isinstance(config, dict) and config.get("vision_config") is not None


def load_student_processor(spec: DistillationJobSpec) -> Processor | None:
    """The student's processor (AutoProcessor of its model directory) when the student is a
    vision-language model (:func:`reads_images`), else None: a text student loads nothing. A VL
    student whose directory holds no image processor is refused in one line."""
    model = spec.student.model
    if not reads_images(model):
        return None
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(
            str(model), local_files_only=True, trust_remote_code=spec.student.trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise ValueError(
            f"student {model}: a vision-language model (its config.json has a vision_config) but its processor "
            f"does not load: {e}"
        ) from e
    if getattr(processor, "image_processor", None) is None or not hasattr(processor, "apply_chat_template"):
        raise ValueError(
            f"student {model}: a vision-language model (its config.json has a vision_config) but AutoProcessor "
            f"gives a {type(processor).__name__}, which reads no images: save the model's processor beside it "
            "(processor.save_pretrained)"
        )
    return cast(Processor, processor)
