"""The student as the trainer runs it: the HF causal LM wrapped to return log-probs, its loading
(with LoRA adapters when spec.trainer.lora asks, its vision tower frozen when
spec.trainer.freezeVision asks), the start-up checks that sequence packing is safe for it and
that the trainer's multimodal positions are the model's, and the weights a sync sends under HF
names: every weight that trains (all of them, all but a frozen vision tower, or only the LoRA
adapters).

Log-probs: the decoder runs on the micro-batch's rows, the LM head only at the positions that
predict response tokens; log pi(y) = logit(y) - logsumexp(logits), and the same for the teacher's
top-k ids (forwardKLTopK).

A vision-language student (a Qwen-VL style ``...ForConditionalGeneration``: a config with a
``vision_config``; its multimodal core ``.model`` holds ``visual`` and ``language_model``) runs
its core instead of the bare decoder: the vision tower encodes the micro-batch's pixel rows, their
features replace the image pad tokens' embeddings (and deepstack adds them to the first decoder
layers), and the decoder runs with the M-RoPE position ids collate made (microbatch.py). A
micro-batch without images runs the core without vision inputs: the plain text path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kubedistill.api.spec import DistillationJobSpec, LoraSpec
from kubedistill.runtime.models.loading import is_vision_language, load_causal_lm
from kubedistill.runtime.trainer.lora import adapter_wire, apply_lora, wire_name
from kubedistill.runtime.trainer.microbatch import VisionTokens, collate, mrope_positions
from kubedistill.runtime.wire.batch import SampleImages, TrainBatch
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
        self.vision: VisionTokens | None = vision_tokens(lm.config)
        """Set for a vision-language student: its image pad token and spatial merge."""

    def hf_model(self) -> Any:
        """The HF model itself (under PEFT's wrappers with LoRA)."""
        return self.lm.get_base_model() if self.lora is not None else self.lm

    def vl_core(self) -> Any:
        """A vision-language student's multimodal core (``visual`` + ``language_model``)."""
        return self.hf_model().model

    def vision_tower(self) -> Any | None:
        """The vision tower (patch embedding, blocks, mergers) of a vision-language student."""
        return self.vl_core().visual if self.vision is not None else None

    def forward(
        self,
        input_ids: torch.Tensor,
        gather_index: torch.Tensor,
        targets: torch.Tensor,
        topk_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        touch_vision: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of `targets` at the flat positions `gather_index` of the rows `input_ids`
        (and of `topk_ids` there); `pixel_values`/`image_grid_thw`: the rows' images in order
        (a vision-language student); `touch_vision`: see MicroBatch.touch_vision."""
        if self.vision is None:
            hidden = self.lm.get_decoder()(
                input_ids=input_ids, position_ids=position_ids, use_cache=False
            ).last_hidden_state
        else:
            core = self.vl_core()
            # Before the decoder, where a micro-batch with images runs the tower too: FSDP gathers
            # the sharded modules in call order, which must be the same on every rank.
            touch = placeholder_vision(core.visual, input_ids.device) if touch_vision and pixel_values is None else None
            # Position ids are always given with images ([4, rows, L] from collate), so the core
            # never computes (nor caches) its own M-RoPE and needs no mm_token_type_ids.
            hidden = core(
                input_ids=input_ids,
                position_ids=position_ids,
                pixel_values=pixel_values,
                image_grid_thw=image_grid_thw,
                use_cache=False,
            ).last_hidden_state
            if touch is not None:
                hidden = hidden + touch
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, gather_index)
        logits = self.lm.get_output_embeddings()(h).float()
        lse = torch.logsumexp(logits, dim=-1)
        token_lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        topk_lp = logits.gather(-1, topk_ids) - lse.unsqueeze(-1) if topk_ids is not None else None
        return token_lp, topk_lp

    if TYPE_CHECKING:
        # nn.Module.__call__ runs the hooks, then forward.
        __call__ = forward


def vision_tokens(hf_config: Any) -> VisionTokens | None:
    """The image pad token and spatial merge of a vision-language config; None for a text one."""
    if not is_vision_language(hf_config):
        return None
    return VisionTokens(image_token_id=hf_config.image_token_id, merge=hf_config.vision_config.spatial_merge_size)


def placeholder_vision(visual: Any, device: torch.device) -> torch.Tensor:
    """A zero that depends on every parameter of the vision tower: its outputs for one blank
    image of one merged token, times 0. Added to the hidden states of a micro-batch without images
    when FSDP needs the (sharded) tower to run in lock-step with other ranks; its gradients are
    zeros, so it changes neither the loss nor the step."""
    cfg = visual.config
    m = cfg.spatial_merge_size
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    out = visual(
        torch.zeros((m * m, patch_dim), device=device),
        grid_thw=torch.tensor([[1, m, m]], device=device),
        return_dict=True,
    )
    total = out.pooler_output.float().sum() + sum(f.float().sum() for f in out.deepstack_features)
    return total * 0.0


def load_student(spec: DistillationJobSpec, path: str | Path, device: torch.device) -> LogProbModel:
    """The student from the local HF directory `path` in fp32 (FSDP keeps fp32 master weights),
    wrapped and moved to `device`; not yet sharded. A vision-language student's M-RoPE positions
    are checked against its own (check_mrope); freezeVision freezes its vision tower, and is
    refused for a text student."""
    lm = load_causal_lm(
        path, dtype="float32", what="spec.student.model", trust_remote_code=spec.student.trust_remote_code
    )
    if spec.trainer.freeze_vision and not is_vision_language(lm.config):
        raise ValueError(
            f"spec.trainer.freezeVision: the student {path} ({type(lm).__name__}) has no vision tower to freeze"
        )
    if spec.trainer.gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    lm.config.use_cache = False
    lora = spec.trainer.lora
    model = LogProbModel(apply_lora(lm, lora) if lora is not None else lm, lora)
    if model.vision is not None:
        check_mrope(model)
        if spec.trainer.freeze_vision:
            model.vl_core().visual.requires_grad_(False)
    model.to(device)
    return model


def check_mrope(model: LogProbModel) -> None:
    """Refuse a vision-language student whose own multimodal positions (its core's
    ``get_rope_index``) differ from the trainer's (microbatch.mrope_positions) on a sample with
    two images of different grids between text: the trainer would silently compute other
    positions than the model was trained with and than the rollout engine uses."""
    vision = model.vision
    assert vision is not None
    core = model.vl_core()
    get_rope_index = getattr(core, "get_rope_index", None)
    m, pad = vision.merge, vision.image_token_id
    grids = torch.tensor([[1, 2 * m, 3 * m], [1, 4 * m, m]])
    counts = vision.tokens_per_image(grids).tolist()
    other = 0 if pad != 0 else 1
    ids = torch.tensor([other] * 3 + [pad] * counts[0] + [other] * 2 + [pad] * counts[1] + [other] * 4)
    theirs = None
    if get_rope_index is not None:
        try:
            theirs = get_rope_index(ids[None], mm_token_type_ids=(ids == pad).int()[None], image_grid_thw=grids)[0]
        except TypeError:  # another signature: not a model whose positions the trainer knows
            theirs = None
    if theirs is None or not torch.equal(theirs[:, 0], mrope_positions(ids, grids, vision)):
        raise ValueError(
            f"spec.student.model: {type(model.hf_model()).__name__} computes multimodal positions the trainer "
            "does not (it follows Qwen-VL's M-RoPE: get_rope_index of Qwen2-VL, Qwen2.5-VL, Qwen3-VL)"
        )


def pad_token_id(hf_config: Any) -> int:
    """The id right-padded rows are filled with: the model's pad token, else 0 (masked anyway)."""
    pad: int | None = getattr(hf_config, "pad_token_id", None)
    if pad is None:  # a vision-language config may keep it in its text config only
        pad = getattr(hf_config.get_text_config(), "pad_token_id", None)
    return pad if pad is not None else 0


def vocab_size(hf_config: Any) -> int:
    """The LM head's width (a vision-language config keeps it in its text config)."""
    size: int = hf_config.get_text_config().vocab_size
    return size


def packing_is_exact(model: LogProbModel, device: torch.device, atol: float = 1e-4) -> bool:
    """Whether two sequences packed into one row (position ids restarting at the second) give the
    same log-probs as each alone. transformers' own attention code turns restarting position ids
    into a block-causal mask (varlen on flash-attention); a model with its own attention code may
    not, and would silently let packed samples attend to each other. A vision-language student
    must also pack image samples exactly (packed_images_are_exact). Runs before sharding."""
    if model.vision is not None and not packed_images_are_exact(model, device, atol):
        return False
    with torch.no_grad():
        vocab = vocab_size(model.lm.config)
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


def packed_images_are_exact(model: LogProbModel, device: torch.device, atol: float = 1e-4) -> bool:
    """Whether image samples packed into one row with a text sample (the trainer's own collate:
    M-RoPE positions per sample, the text positions restarting) give the log-probs each sample
    has alone: the image features must land on their own sample's pad tokens, deepstack too, and
    no sample may see another."""
    vision = model.vision
    assert vision is not None
    cfg = model.vl_core().visual.config
    batch = _image_probe_batch(vocab_size(model.lm.config), vision, cfg)
    tensors = batch.to_tensors()
    weights = torch.zeros(sum(tensors.response_lens))

    def logprobs(rows: list[list[int]]) -> torch.Tensor:
        mb = collate(tensors, rows, weights, None, 0, vision=vision).to(device)
        lp, _ = model(
            mb.input_ids,
            mb.gather_index,
            mb.targets,
            None,
            mb.position_ids,
            pixel_values=mb.pixel_values,
            image_grid_thw=mb.image_grid_thw,
        )
        return lp.float()

    with torch.no_grad():
        alone = torch.cat([logprobs([[i]]) for i in range(len(batch))])
        try:
            packed = logprobs([list(range(len(batch)))])
        except Exception:  # a model that refuses these position ids cannot pack image samples either
            return False
    return bool(torch.allclose(packed, alone, atol=atol))


def _image_probe_batch(vocab: int, vision: VisionTokens, vision_config: Any) -> TrainBatch:
    """Three short samples for packed_images_are_exact: one image, text only, two images of
    different grids; random ids (never the image pad) and random pixels."""
    g = torch.Generator().manual_seed(0)
    m = vision.merge
    patch_dim = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2

    def text(n: int) -> list[int]:
        ids = torch.randint(0, vocab, (n,), generator=g)
        out: list[int] = torch.where(ids == vision.image_token_id, (ids + 1) % vocab, ids).tolist()
        return out

    def images(*grids: tuple[int, int, int]) -> tuple[list[int], SampleImages]:
        grid = torch.tensor(grids)
        pads = [[vision.image_token_id] * int(c) for c in vision.tokens_per_image(grid)]
        pixels = torch.randn(int(grid.prod(dim=1).sum()), patch_dim, generator=g)
        ids = [tok for run in pads for tok in (*text(2), *run)]
        return ids, SampleImages(pixels.numpy(), grid.numpy().astype("int64"))

    one, one_img = images((1, m, 2 * m))
    two, two_img = images((1, 2 * m, m), (1, m, m))
    prompts = [text(3) + one, text(6), text(2) + two]
    responses = [text(4), text(3), text(5)]
    return TrainBatch(
        token_ids=[p + r for p, r in zip(prompts, responses)],
        prompt_lens=[len(p) for p in prompts],
        rollout_logprobs=[[0.0] * len(r) for r in responses],
        images=[one_img, None, two_img],
    )


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
    """(HF name, parameter) of what a weight sync sends, in a fixed order: what trains. Every
    parameter (a tied lm_head once, under its embedding's name) but a frozen vision tower
    (freezeVision: the receivers loaded the same tower and it never changes), or with LoRA only
    the adapters, under the names PEFT saves them by."""
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if model.lora is None:
            yield name[len(LM_PREFIX) :], p
        elif (wire := wire_name(name)) is not None:
            yield wire, p


def frozen_prefixes(model: LogProbModel) -> list[str]:
    """HF name prefixes of the weights a sync leaves out because they never change (freezeVision:
    the vision tower, ``model.visual.``): a receiver keeps its own copy of those."""
    if model.vision is None or model.lora is not None:
        return []
    core = model.vl_core()
    if any(p.requires_grad for p in core.visual.parameters()):
        return []
    prefix = next(name for name, module in model.lm.named_modules() if module is core.visual)
    return [prefix + "."]


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
