"""LoRA students on the trainer (spec.trainer.lora): PEFT adapters on the frozen HF model, their
names on the wire, and what a receiver needs to apply them.

The adapters are PEFT's own (``get_peft_model``): the trainer optimises, checkpoints and sends
only their tensors. On the wire an adapter tensor keeps the name PEFT saves it under
(``model.layers.0.self_attn.q_proj.lora_A.weight``: the base linear's HF name, then
``lora_A``/``lora_B``), which is also what vLLM's LoRA loader and PEFT's adapter files use.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from kubedistill.api.enums import ALL_LINEAR
from kubedistill.api.spec import LoraSpec
from kubedistill.runtime.wire.protocol import LoraAdapter

ADAPTER = "default"
"""PEFT's name of the one adapter the trainer trains."""

_PEFT_PREFIX = "base_model.model."
_ADAPTER_PARAM = re.compile(rf"^(?P<module>.+)\.(?P<which>lora_A|lora_B)\.{ADAPTER}\.weight$")


def lora_config(spec: LoraSpec, target_modules: list[str] | str) -> Any:
    """The PEFT LoraConfig of `spec` for the resolved `target_modules`."""
    from peft import LoraConfig

    return LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=target_modules,
        bias="none",
    )


def linear_leaf_names(lm: Any) -> list[str]:
    """Leaf names of the model's linear layers outside the output head, sorted: what
    targetModules may name."""
    from torch import nn

    head = lm.get_output_embeddings()
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in lm.named_modules()
        if isinstance(module, nn.Linear) and module is not head
    }
    return sorted(names)


def resolve_targets(spec: LoraSpec, lm: Any) -> list[str] | str:
    """spec.targetModules checked against the model: a name it lacks is refused in one line that
    lists the names it has."""
    if spec.target_modules == [ALL_LINEAR]:
        return ALL_LINEAR
    have = linear_leaf_names(lm)
    missing = [t for t in spec.target_modules if t not in have]
    if missing:
        raise ValueError(
            f"spec.trainer.lora.targetModules: {', '.join(missing)} not in {type(lm).__name__}; "
            f"its linear modules are {', '.join(have)} (or use all-linear)"
        )
    return list(spec.target_modules)


INIT_SEED = 0
"""Seed of the adapters' random init (A; B starts at zero): every rank must build the same
adapters before FSDP shards them, and a rerun the same ones."""


def apply_lora(lm: Any, spec: LoraSpec) -> Any:
    """`lm` with PEFT LoRA adapters on its target modules; only the adapters require grad."""
    import torch
    from peft import get_peft_model

    config = lora_config(spec, resolve_targets(spec, lm))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        peft_model = get_peft_model(lm, config)
    if getattr(lm, "is_gradient_checkpointing", False):
        # Checkpointed blocks need an input that requires grad when every base weight is frozen.
        peft_model.enable_input_require_grads()
    return peft_model


def wire_name(param_name: str) -> str | None:
    """PEFT's parameter name (after any wrapper prefix) -> the adapter tensor's name on the wire
    and in PEFT's saved files; None for a frozen base parameter."""
    i = param_name.find(_PEFT_PREFIX)
    if i < 0:
        return None
    m = _ADAPTER_PARAM.match(param_name[i + len(_PEFT_PREFIX) :])
    if m is None:
        return None
    return f"{m['module']}.{m['which']}.weight"


def is_adapter_param(param_name: str) -> bool:
    return wire_name(param_name) is not None


def adapted_leaf_names(wire_names: Iterable[str]) -> list[str]:
    """The adapted modules' leaf names (q_proj, ...) as an adapter config lists them."""
    return sorted({n.rsplit(".", 2)[0].rsplit(".", 1)[-1] for n in wire_names})


def scale(spec: LoraSpec) -> float:
    """What B @ A is multiplied by (PEFT's scaling of a LoRA layer without rsLoRA)."""
    return spec.alpha / spec.rank


def adapter_wire(spec: LoraSpec, wire_names: Iterable[str]) -> LoraAdapter:
    """The manifest's `lora` section for an adapter made of `wire_names`."""
    assert math.isfinite(scale(spec))
    return LoraAdapter(
        rank=spec.rank,
        alpha=spec.alpha,
        scale=scale(spec),
        target_modules=adapted_leaf_names(wire_names),
        serve_as=spec.serve_as.value,
    )
