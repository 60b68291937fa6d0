"""A vision-language student's image inputs, made at buffer entry: a prompt's images (base64
strings of PNG/JPEG bytes, as the driver keeps them per group) become what the student's forward
takes, through the student's own image processor (AutoProcessor of its model directory):
``pixel_values`` (float32 [patches, D]) and ``image_grid_thw`` (int64 [images, 3]).

The prompt ids of such a sample are already the processor-expanded ids (the data path renders
them through the same processor: one image pad token per merged patch), so the two must agree:
``count(image pad) == sum(t * h * w) / merge**2``. A sample where they do not is refused in one
line naming it; the model would otherwise raise deep in its forward, or worse, read another
image's features. Made once per group (its samples share the prompt), on the driver's thread:
processing an image costs milliseconds, and a text job never loads the processor.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kubedistill.runtime.wire.batch import SampleImages


def decode_image(data: str, where: str) -> Any:
    """A PIL RGB image of one base64 string of encoded image bytes; a one-line error otherwise."""
    from PIL import Image, UnidentifiedImageError

    try:
        raw = base64.b64decode(data, validate=True)
        with Image.open(io.BytesIO(raw)) as img:
            return img.convert("RGB")
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as e:
        raise ValueError(
            f"{where}: an image is not base64 of PNG/JPEG bytes ({type(e).__name__}: {_line(e)})"
        ) from None


def expected_pad_tokens(grid_thw: np.ndarray, merge: int) -> int:
    """Image pad tokens the processor writes for images of these grids (one per merged patch)."""
    return int(grid_thw.prod(axis=1).sum()) // (merge * merge)


def check_pad_tokens(
    prompt_ids: Sequence[int], image_token_id: int, grid_thw: np.ndarray, merge: int, where: str
) -> None:
    """Refuse prompt ids whose image pad tokens are not the processor's expansion of these images."""
    have = int(np.count_nonzero(np.asarray(prompt_ids) == image_token_id))
    want = expected_pad_tokens(grid_thw, merge)
    if have != want:
        raise ValueError(
            f"{where}: its prompt has {have} image pad tokens (id {image_token_id}) but its {len(grid_thw)} "
            f"image(s) of grids {grid_thw.tolist()} need {want}: the prompt must be the student processor's "
            "expanded ids of these images"
        )


class StudentImages:
    """The student's image processor, loaded on first use from its model directory."""

    def __init__(self, model_dir: str | Path, trust_remote_code: bool = False):
        self.model_dir = Path(model_dir)
        self.trust_remote_code = trust_remote_code
        self._processor: Any = None
        self.image_token_id = -1
        self.merge = 1

    def _load(self, where: str) -> Any:
        if self._processor is None:
            from transformers import AutoProcessor

            try:
                processor = AutoProcessor.from_pretrained(
                    str(self.model_dir), local_files_only=True, trust_remote_code=self.trust_remote_code
                )
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"{where} has images but {self.model_dir} has no processor to read them: {_line(e)}"
                ) from e
            image_processor = getattr(processor, "image_processor", None)
            token_id = getattr(processor, "image_token_id", None)
            if image_processor is None or token_id is None:
                raise ValueError(
                    f"{where} has images but the student {self.model_dir} is a text model (its processor "
                    f"{type(processor).__name__} reads no images)"
                )
            self.image_token_id = int(token_id)
            self.merge = int(getattr(image_processor, "merge_size", 1))
            self._processor = image_processor
        return self._processor

    def encode(self, images: Sequence[str], prompt_ids: Sequence[int], where: str) -> SampleImages:
        """The arrays of a prompt's images, checked against its expanded ids."""
        processor = self._load(where)
        pil = [decode_image(data, where) for data in images]
        out = processor(images=pil, return_tensors="pt")
        pixel_values = out["pixel_values"].float().numpy()
        grid = out["image_grid_thw"].numpy().astype(np.int64)
        check_pad_tokens(prompt_ids, self.image_token_id, grid, self.merge, where)
        arrays = SampleImages(np.ascontiguousarray(pixel_values), np.ascontiguousarray(grid))
        arrays.check(where)
        return arrays


def _line(e: BaseException) -> str:
    """An exception's message cut to its first line (errors here are one line)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
