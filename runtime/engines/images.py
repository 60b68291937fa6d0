"""The images of a vision-language request, as both engines take them (pure helpers, no model).

A request's `images` are base64 image files, and its ids (`prompt_token_ids`, or a score's
`token_ids`) are the processor-expanded ids the trainer and the driver use: each image is one run
of the model's image pad token, one pad per merged patch (runtime/driver/multimodal.py). Before
either engine looks at the pixels, the runs are counted against the images: one run per image,
in order, else a one-line 400.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kubedistill.runtime.driver.multimodal import MAX_IMAGES_PER_ROW
from kubedistill.runtime.engines.base import BadRequest

if TYPE_CHECKING:
    from PIL.Image import Image

MAX_IMAGES_PER_PROMPT = MAX_IMAGES_PER_ROW
"""Images one request may carry: the driver's limit per row; vLLM is started with it as
limit_mm_per_prompt."""


def decode_images(images: Sequence[str]) -> list[Image]:
    """Base64 image files from the wire -> RGB PIL images (a one-line 400 for one that is not)."""
    from PIL import Image

    out = []
    for i, b64 in enumerate(images):
        try:
            img = Image.open(io.BytesIO(base64.b64decode(b64, validate=True)))
            img.load()
        except Exception as e:
            raise BadRequest(f"images[{i}] is not a base64-encoded image: {type(e).__name__}") from None
        out.append(img.convert("RGB"))
    return out


def pad_runs(ids: Sequence[int], pad: int) -> list[tuple[int, int]]:
    """(start, length) of every run of `pad` in `ids`, in order."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != pad:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def check_image_runs(ids: Sequence[int], pad: int, images: int, field_name: str) -> list[tuple[int, int]]:
    """The image pad runs of a request's ids, one per image, else BadRequest (one line)."""
    if images > MAX_IMAGES_PER_PROMPT:
        raise BadRequest(f"images: {images} images, more than the limit of {MAX_IMAGES_PER_PROMPT} per request")
    runs = pad_runs(ids, pad)
    if len(runs) != images:
        raise BadRequest(
            f"{field_name} holds {len(runs)} run(s) of the image pad token (id {pad}) for {images} image(s); "
            "send the processor-expanded ids, one run of pads per image"
        )
    return runs


def text_only(field_name: str = "images") -> BadRequest:
    return BadRequest(f"{field_name}: this server's model is text-only; images need a vision-language model")


def image_pad_id(hf_config: Any, tokenizer_dir: str | None = None) -> int:
    """The id of a vision-language model's image pad token: its config's `image_token_id`
    (Qwen-VL) or `image_token_index` (LLaVA style), else its tokenizer's `image_token`."""
    for attr in ("image_token_id", "image_token_index"):
        value = getattr(hf_config, attr, None)
        if isinstance(value, int):
            return value
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        token = getattr(tok, "image_token", None)
        if token is not None:
            return int(tok.convert_tokens_to_ids(token))
    raise ValueError(
        "a vision-language model without an image pad token (no config image_token_id, no tokenizer image_token)"
    )


VISION_TOKEN_ATTRS = (
    "image_token_id",
    "image_token_index",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)
"""Config attributes naming a vision-language model's placeholder tokens (Qwen-VL, LLaVA style)."""
NEVER_SAMPLED = -100.0
"""The logit bias that keeps a token from being sampled (e^-100 of its probability)."""


def vision_token_ids(hf_config: Any) -> list[int]:
    """Ids a rollout engine must never sample: a vision-language model's image/video pads and
    vision start/end markers. Generated, they would be taken for image placeholders downstream
    (the teachers' and the trainer's image runs no longer match the images: the sample, and after
    its retries the job, fail). [] for a text model. The reported log-probs stay the raw model's,
    as the trainer computes them."""
    ids = {getattr(hf_config, attr, None) for attr in VISION_TOKEN_ATTRS}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)


def check_prefix(prefix: Sequence[int], pad: int) -> None:
    """A resumed request's prefix (response tokens) must not hold the image pad: the model would
    take it for an image's place (the trainer refuses such a sample too)."""
    if pad in prefix:
        raise BadRequest(
            f"prefix_token_ids hold the image pad token (id {pad}) at {list(prefix).index(pad)}; "
            "a response cannot hold image placeholders"
        )
