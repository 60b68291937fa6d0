"""Tiny HF models and tokenizers built on the spot (tests, the CPU quickstart, benchmarks).

Nothing is downloaded: tokenizers are trained or enumerated here with `tokenizers`, models are
random-weight Qwen2/Llama configs saved as safetensors. head_dim is 64 because vLLM's CPU
attention backend rejects smaller heads.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PretrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
# Plain concatenation of the messages after <bos>: tiny task models have no chat roles.
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


class ModelShape(TypedDict, total=False):
    """tiny_config's size arguments, passed through by build_tiny_model and build_tiny_bpe_model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool


def _wrap(tok: Tokenizer, out_dir: Path | None) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK)
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def char_tokenizer(alphabet: str, out_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet` (after the 4 special tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return _wrap(tok, out_dir)


def bpe_tokenizer(corpus: Iterable[str], vocab_size: int = 512, out_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return _wrap(tok, out_dir)


def tiny_config(
    vocab_size: int,
    *,
    arch: str = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int | None = None,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
) -> PretrainedConfig:
    """A small Qwen2 or Llama config with head_dim = hidden_size / num_heads (keep it ≥ 64)."""
    from transformers import LlamaConfig, Qwen2Config

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    return cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=SPECIALS.index(BOS),
        eos_token_id=SPECIALS.index(EOS),
        pad_token_id=SPECIALS.index(PAD),
        dtype="float32",
    )


def build_tiny_model(
    out_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    seed: int = 0,
    *,
    arch: str = "qwen2",
    **shape: Unpack[ModelShape],
) -> Path:
    """Save a random-weight model (safetensors) and `tokenizer` into `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config(len(tokenizer), arch=arch, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def tiny_corpus(lines: int = 200, seed: int = 0) -> list[str]:
    """Deterministic English-like text to train a small BPE tokenizer on (no downloads)."""
    import random

    words = (
        "the a student teacher model learns from token weights loss step batch prompt answer "
        "sum of two numbers is equal to plus minus and then we check if it is right"
    ).split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(12)) + f" {rng.randint(0, 999)}" for _ in range(lines)]


def build_tiny_bpe_model(
    out_dir: Path, *, arch: str = "llama", vocab_size: int = 300, seed: int = 0, **shape: Unpack[ModelShape]
) -> Path:
    """A random-weight model with a byte-level BPE tokenizer trained here on :func:`tiny_corpus`."""
    tok = bpe_tokenizer(tiny_corpus(seed=seed), vocab_size=vocab_size)
    return build_tiny_model(out_dir, tok, seed=seed, arch=arch, **shape)
