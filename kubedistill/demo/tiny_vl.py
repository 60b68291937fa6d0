"""A tiny random Qwen3-VL built on the spot: a vision-language student or vision teacher for tests,
the CPU twin of the reference job and benchmarks (nothing downloaded).

`build_tiny_vl_model(out_dir, seed=...)` writes a model directory holding
- the random-weight `Qwen3VLForConditionalGeneration` (safetensors, float32): text side vocab ~512,
  hidden 128, 2 layers, 2 heads / 1 KV head of head_dim 64 (vLLM's CPU attention rejects smaller
  heads), interleaved M-RoPE (sections [12, 10, 10]); vision side depth 2, hidden 128, patch 16,
  spatial merge 2, temporal patch 2, deepstack from block 0;
- the tokenizer (byte-level BPE trained here by :func:`vl_tokenizer`, digits split one per token)
  whose chat template writes `<|vision_start|><|image_pad|><|vision_end|>` for an image part;
- the `Qwen3VLProcessor` (a `Qwen2VLImageProcessor` with patch 16 and merge 2 plus the
  `Qwen3VLVideoProcessor`), so `AutoProcessor.from_pretrained(out_dir)` and vLLM load it.

A 64x64 image becomes 4 `<|image_pad|>` tokens (grid [1, 4, 4] of 16-pixel patches, merged 2x2).
The tokenizer depends on nothing but this module, so every model built here shares it (students
and teachers must); the seed draws the weights only. Deterministic given the seed and the shape.
Needs torchvision (the video processor): on CPU machines see kubedistill.runtime.torchvision_cpu.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack

from kubedistill.demo.tiny import BOS, EOS, PAD, SPECIALS, UNK

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast, ProcessorMixin

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VL_SPECIALS = [*SPECIALS, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
"""What the chat template writes for one image (before the processor expands the pad)."""
# Plain concatenation after <bos>, as tiny.CHAT_TEMPLATE (no chat roles), plus multimodal content:
# a message's content is a string or a list of {type: text|image|video} parts.
VL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    f"{{% if p['type'] == 'image' %}}{IMAGE_PLACEHOLDER}"
    f"{{% elif p['type'] == 'video' %}}{VISION_START}{VIDEO_PAD}{VISION_END}"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
)
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 16, 2, 2
MIN_PIXELS = 32 * 32
"""Smallest resized image: one merged token (patch 16 x merge 2 = 32 pixels a side)."""
MAX_PIXELS = 256 * 256
"""Largest resized image: 64 merged tokens; bigger images are scaled down to this."""


class VLShape(TypedDict, total=False):
    """build_tiny_vl_model's size arguments (see tiny_vl_config)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    vision_depth: int
    vision_hidden_size: int
    vision_heads: int
    vision_intermediate_size: int
    tie_word_embeddings: bool


def vl_corpus(lines: int = 400) -> list[str]:
    """Text the tokenizer is trained on: the arithmetic prompts, the image task's questions and
    some English-like filler (fixed: every tiny VL model shares one tokenizer)."""
    import random

    from kubedistill.demo.tiny import tiny_corpus

    rng = random.Random(0)
    arith = [f"{rng.randint(0, 99):02d}+{rng.randint(0, 99):02d}={rng.randint(0, 198)}" for _ in range(lines)]
    words = "How many dots are in the picture image count answer with one digit what number see".split()
    questions = [" ".join(rng.choice(words) for _ in range(10)) + f"? {rng.randint(0, 9)}" for _ in range(lines)]
    return tiny_corpus(lines) + arith + questions + ["How many dots?"] * lines


def vl_tokenizer(vocab_size: int = 512, out_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (one token per digit) with the Qwen-VL vision tokens and
    VL_CHAT_TEMPLATE. `vocab_size` counts the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=VL_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(vl_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens=[VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD],
    )
    fast.chat_template = VL_CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def vl_processor(tokenizer: PreTrainedTokenizerFast) -> ProcessorMixin:
    """The Qwen3VLProcessor of the tiny models: images resized to multiples of 32 pixels between
    MIN_PIXELS and MAX_PIXELS, normalised to [-1, 1] as Qwen3-VL's own processor does."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    common = dict(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    image = Qwen2VLImageProcessor(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, **common)
    video = Qwen3VLVideoProcessor(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS * 8}, **common)
    return Qwen3VLProcessor(
        image_processor=image, tokenizer=tokenizer, video_processor=video, chat_template=VL_CHAT_TEMPLATE
    )


def tiny_vl_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    max_position_embeddings: int = 1024,
    vision_depth: int = 2,
    vision_hidden_size: int = 128,
    vision_heads: int = 2,
    vision_intermediate_size: int = 256,
    tie_word_embeddings: bool = True,
) -> PretrainedConfig:
    """A small Qwen3-VL config. The text side's head_dim is 64 whatever hidden_size (M-RoPE's
    sections [12, 10, 10] cover its 32 frequencies); the vision tower projects to hidden_size."""
    from transformers import Qwen3VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=64,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [12, 10, 10],
            "mrope_interleaved": True,
        },
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    vision = dict(
        depth=vision_depth,
        hidden_size=vision_hidden_size,
        intermediate_size=vision_intermediate_size,
        num_heads=vision_heads,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        out_hidden_size=hidden_size,
        num_position_embeddings=256,  # a 16x16 grid, interpolated to each image's patch grid
        deepstack_visual_indexes=[0],
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def build_tiny_vl_model(
    out_dir: Path,
    seed: int = 0,
    *,
    tokenizer: PreTrainedTokenizerFast | None = None,
    **shape: Unpack[VLShape],
) -> Path:
    """Save a random-weight tiny Qwen3-VL (safetensors), its tokenizer and its processor into
    `out_dir`. Student and vision teacher: the same call with other seeds and sizes (they share
    the tokenizer)."""
    import torch
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else vl_tokenizer()
    config = tiny_vl_config(tok, **shape)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration._from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    vl_processor(tok).save_pretrained(str(out_dir))  # tokenizer files, chat template and both processors
    return out_dir
