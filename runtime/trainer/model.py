"""The student as the trainer runs it: the HF causal LM wrapped to return log-probs, its loading
(with LoRA adapters when spec.trainer.lora asks), the start-up check that sequence packing is
safe for it, and the weights a sync sends under HF names: every weight, or only the adapters.

Log-probs: the decoder runs on the micro-batch's rows, the LM head only at the positions that
predict response tokens; log pi(y) = logit(y) - logsumexp(logits), and the same for the teacher's
top-k ids (forwardKLTopK).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kubedistill.api.spec import DistillationJobSpec, LoraSpec
from kubedistill.runtime.models.loading import load_causal_lm
from kubedistill.runtime.trainer.lora import adapter_wire, apply_lora, wire_name
from kubedistill.runtime.wire.dtypes import dtype_name
from kubedistill.runtime.wire.protocol import LoraAdapter, TensorMeta

log = logging.getLogger("kubedistill.trainer")

LM_PREFIX = "lm."
"""Prefix of the HF model's parameter names inside :class:`LogProbModel` (and in checkpoints)."""

if TYPE_CHECKING:

    class _Module:
        """What mypy sees of ``nn.Module``: torch is typed as Any here, and a class derived from
        Any is refused; attributes of the module resolve to Any, as they would through torch."""

        def __init__(self) -> None: ...
        def __getattr__(self, name: str) -> Any: ...

else:
    _Module = nn.Module


class LogProbModel(_Module):
    """Wraps the HF causal LM: decoder on all positions, LM head only where log-probs are needed.

    Wrapping (instead of calling submodules of an FSDP-sharded model) keeps FSDP2's root hooks
    in charge of gathering the embedding, final norm and LM head.
    """

    def __init__(self, lm: Any, lora: LoraSpec | None = None):
        super().__init__()
        self.lm = lm
        self.lora = lora
        """Set when `lm` is a PEFT model whose LoRA adapters are all that trains."""

    def forward(
        self,
        input_ids: torch.Tensor,
        gather_index: torch.Tensor,
        targets: torch.Tensor,
        topk_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.lm.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, gather_index)
        logits = self.lm.get_output_embeddings()(h).float()
        lse = torch.logsumexp(logits, dim=-1)
        token_lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        topk_lp = logits.gather(-1, topk_ids) - lse.unsqueeze(-1) if topk_ids is not None else None
        return token_lp, topk_lp

    if TYPE_CHECKING:
        # nn.Module.__call__ runs the hooks, then forward.
        __call__ = forward


def load_student(spec: DistillationJobSpec, path: str | Path, device: torch.device) -> LogProbModel:
    """The student from the local HF directory `path` in fp32 (FSDP keeps fp32 master weights),
    wrapped and moved to `device`; not yet sharded."""
    lm = load_causal_lm(
        path, dtype="float32", what="spec.student.model", trust_remote_code=spec.student.trust_remote_code
    )
    if spec.trainer.gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    lm.config.use_cache = False
    lora = spec.trainer.lora
    model = LogProbModel(apply_lora(lm, lora) if lora is not None else lm, lora)
    model.to(device)
    return model


def pad_token_id(hf_config: Any) -> int:
    """The id right-padded rows are filled with: the model's pad token, else 0 (masked anyway)."""
    pad: int | None = hf_config.pad_token_id
    return pad if pad is not None else 0


def packing_is_exact(model: LogProbModel, device: torch.device, atol: float = 1e-4) -> bool:
    """Whether two sequences packed into one row (position ids restarting at the second) give the
    same log-probs as each alone. transformers' own attention code turns restarting position ids
    into a block-causal mask (varlen on flash-attention); a model with its own attention code may
    not, and would silently let packed samples attend to each other. Runs before sharding."""
    with torch.no_grad():
        vocab = model.lm.config.vocab_size
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randint(0, vocab, (n,), generator=g) for n in (7, 5))
        targets = torch.cat([a[1:], b[1:]]).to(device)
        alone = torch.cat(
            [
                model(seq[None].to(device), torch.arange(len(seq) - 1, device=device), seq[1:].to(device), None)[0]
                for seq in (a, b)
            ]
        )
        ids = torch.cat([a, b])[None].to(device)
        positions = torch.cat([torch.arange(len(a)), torch.arange(len(b))])[None].to(device)
        index = torch.cat([torch.arange(len(a) - 1), torch.arange(len(b) - 1) + len(a)]).to(device)
        try:
            packed = model(ids, index, targets, None, positions)[0]
        except Exception:  # a model that refuses position ids of this shape cannot pack either
            return False
        return bool(torch.allclose(packed.float(), alone.float(), atol=atol))


def use_packing(spec: DistillationJobSpec, model: LogProbModel, device: torch.device) -> bool:
    """trainer.packSequences, unless the model fails :func:`packing_is_exact` (then padded rows,
    with a warning)."""
    if not spec.trainer.pack_sequences:
        return False
    if packing_is_exact(model, device):
        return True
    log.warning(
        "trainer.packSequences: %s does not keep packed samples apart (its attention ignores "
        "position-id packing); training on padded rows instead",
        type(model.lm).__name__,
    )
    return False


def synced_params(model: LogProbModel) -> Iterator[tuple[str, Any]]:
    """(HF name, parameter) of what a weight sync sends, in a fixed order: every parameter (a
    tied lm_head once, under its embedding's name), or with LoRA only the adapters, under the
    names PEFT saves them by."""
    for name, p in model.named_parameters():
        if model.lora is None:
            yield name[len(LM_PREFIX) :], p
        elif (wire := wire_name(name)) is not None:
            yield wire, p


def weight_metas(model: LogProbModel) -> list[TensorMeta]:
    """Name, dtype and full shape of what full_weights yields, in its order, without gathering
    (a sharded parameter's shape is its full shape)."""
    return [TensorMeta(name=name, dtype=dtype_name(p.dtype), shape=list(p.shape)) for name, p in synced_params(model)]


def full_weights(model: LogProbModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of synced_params, each materialised (all-gathered) when reached,
    so every rank must exhaust it."""
    for name, p in synced_params(model):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        yield name, full.detach()


def lora_adapter(model: LogProbModel) -> LoraAdapter | None:
    """The manifest's `lora` section when the model trains LoRA adapters, else None."""
    if model.lora is None:
        return None
    return adapter_wire(model.lora, (name for name, _ in synced_params(model)))
