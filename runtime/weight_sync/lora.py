"""Receiving LoRA adapters instead of full weights (spec.trainer.lora; the trainer's side is
runtime/trainer/lora.py). The pure parts the engines share: tensor names, the manifest check, the
merge arithmetic, which base tensors complete a layer vLLM reloads, and vLLM's adapter limits.

A LoRA manifest (`Manifest.lora` set) carries, for each adapted module `<m>` (the HF name of a
base linear layer whose `<m>.weight` is [out, in]), `<m>.lora_A.weight` [rank, in] and
`<m>.lora_B.weight` [out, rank]. A receiver either merges them (serve_as merged: W = W0 + scale *
B @ A, W0 the base model's weight, so each version replaces the previous one's delta exactly) or
serves them as an adapter (serve_as adapter).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kubedistill.api.enums import ALL_LINEAR, vllm_max_lora_rank
from kubedistill.runtime.weight_sync.manifest import check_layout, layer_of
from kubedistill.runtime.wire.protocol import LoraAdapter, Manifest

if TYPE_CHECKING:
    import torch

_ADAPTER_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
UNSUPPORTED_LEAVES = frozenset({"embed_tokens", "lm_head"})
"""Modules an adapter may not touch: PEFT saves an embedding's adapter under other names, vLLM
serves neither as a linear adapter, and merging into a tied lm_head would change the embedding."""
FLOAT_DTYPES = frozenset({"float32", "bfloat16", "float16", "float64"})

VLLM_ADAPTER_SLOTS = 2
"""max_loras: adapters one vLLM batch may mix. Two covers a weight sync: requests still running
on the previous version's adapter (pause mode 'keep', or 'wait' draining) beside new ones on the
current. A request on a third adapter waits in vLLM's queue until a slot frees (vLLM's
scheduler never admits more), so this bounds throughput at a sync, never correctness."""
VLLM_CPU_ADAPTERS = 8
"""max_cpu_loras: adapters a vLLM worker keeps registered (a few MiB each). The worker keeps the
current version's and every one a request in flight still uses; vLLM would evict the least
recently used one beyond this, and a request on an evicted adapter kills the engine (it would try
to load it from a path that does not exist), so the engine aborts such requests first
(adapters_to_retire)."""


# --- names ------------------------------------------------------------------------------------
def adapter_tensor_name(module: str, part: Literal["A", "B"]) -> str:
    return f"{module}.lora_{part}.weight"


@dataclass(frozen=True)
class AdaptedModule:
    """One base linear layer and its adapter's two tensors, by name."""

    module: str

    @property
    def weight(self) -> str:
        """The base layer's weight, [out, in]: what a merge writes."""
        return f"{self.module}.weight"

    @property
    def a(self) -> str:
        return adapter_tensor_name(self.module, "A")

    @property
    def b(self) -> str:
        return adapter_tensor_name(self.module, "B")

    @property
    def leaf(self) -> str:
        return self.module.rsplit(".", 1)[-1]


def adapted_modules(names: Iterable[str]) -> dict[str, AdaptedModule]:
    """The modules a LoRA manifest's tensor names adapt, in the order they first appear. Every
    name must be an adapter tensor, and each module must have both of its tensors."""
    parts: dict[str, set[str]] = {}
    for name in names:
        m = _ADAPTER_TENSOR.match(name)
        if m is None:
            raise ValueError(f"{name} is not a LoRA adapter tensor (<module>.lora_A.weight or <module>.lora_B.weight)")
        parts.setdefault(m["module"], set()).add(m["part"])
    unpaired = [f"{mod} has no lora_{'B' if p == {'A'} else 'A'}" for mod, p in parts.items() if len(p) != 2]
    if unpaired:
        raise ValueError(f"{_few(unpaired)}")
    return {mod: AdaptedModule(mod) for mod in parts}


# --- the manifest check ------------------------------------------------------------------------
def check_lora_manifest(manifest: Manifest, base: Mapping[str, Sequence[int]]) -> None:
    """A LoRA manifest must adapt linear layers the model has, with shapes that fit them:
    lora_A [rank, in] and lora_B [out, rank] for a base weight [out, in]. Raises ValueError with
    one line saying what does not fit (the server answers 409 and discards the broadcast)."""
    lora = manifest.lora
    if lora is None:
        raise ValueError("manifest mismatch: not a LoRA manifest")
    check_layout(manifest)
    names = [t.name for t in manifest.tensors]
    if len(set(names)) != len(names):
        raise ValueError("manifest mismatch: a tensor name appears twice")
    try:
        modules = adapted_modules(names)
    except ValueError as e:
        raise ValueError(f"manifest mismatch: {e}") from None
    if not modules:
        raise ValueError("manifest mismatch: the LoRA manifest adapts no module")
    unknown = [m for m in modules.values() if m.weight not in base or len(base[m.weight]) != 2]
    if unknown:
        raise ValueError(
            f"manifest mismatch: LoRA adapter for modules the model does not have: {_few(m.module for m in unknown)}"
        )
    refused = [m.module for m in modules.values() if m.leaf in UNSUPPORTED_LEAVES]
    if refused:
        raise ValueError(f"manifest mismatch: LoRA on embeddings or the output head is not supported: {_few(refused)}")
    if ALL_LINEAR not in lora.target_modules:
        outside = [m.module for m in modules.values() if m.leaf not in lora.target_modules]
        if outside:
            raise ValueError(
                f"manifest mismatch: {_few(outside)} not among the adapter's target_modules {lora.target_modules}"
            )
    metas = {t.name: t for t in manifest.tensors}
    for m in modules.values():
        out, inp = base[m.weight]
        for name, want in ((m.a, [lora.rank, inp]), (m.b, [out, lora.rank])):
            t = metas[name]
            if list(t.shape) != want:
                raise ValueError(
                    f"manifest mismatch: {name} has shape {list(t.shape)}; for {m.weight} {[out, inp]} "
                    f"and rank {lora.rank} it must be {want}"
                )
            if t.dtype not in FLOAT_DTYPES:
                raise ValueError(f"manifest mismatch: {name} is {t.dtype}; adapter tensors are floating point")


def same_adapter_layout(lora: LoraAdapter, modules: Collection[str], served: tuple[int, frozenset[str]]) -> str | None:
    """Why an adapter cannot go into the adapter slots an engine already made for `served`
    (rank, modules), or None when it fits them."""
    rank, have = served
    if lora.rank != rank:
        return f"its rank is {lora.rank}, the engine serves rank {rank} adapters"
    if set(modules) != have:
        return f"it adapts {len(modules)} modules, the engine's adapter slots hold {len(have)} others"
    return None


# --- merging ----------------------------------------------------------------------------------
def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """W0 + (B @ A) * scale, computed in float32 on A's device, cast to `dtype`. PEFT merges in
    the same order (delta first, then added), and the result depends only on W0 and this
    version's A and B: nothing of an earlier version survives in it."""
    import torch

    delta = b.to(torch.float32) @ a.to(torch.float32)
    delta.mul_(scale)
    delta.add_(base.to(device=delta.device, dtype=torch.float32))
    return delta.to(dtype)


def read_checkpoint(model_dir: str, names: Collection[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` (those present) from a safetensors checkpoint, in its own dtype, on
    the CPU. Empty when the directory has no safetensors files (a hub id, .bin weights)."""
    from safetensors import safe_open

    wanted = set(names)
    out: dict[str, torch.Tensor] = {}
    d = Path(model_dir)
    for f in sorted(d.glob("*.safetensors")) if d.is_dir() else []:
        with safe_open(str(f), framework="pt") as sf:
            for name in wanted.intersection(sf.keys()):
                out[name] = sf.get_tensor(name)
    return out


class BaseWeights:
    """The base model's tensors LoRA versions are merged into, read from the checkpoint on disk
    once each and kept on the CPU in the checkpoint's dtype. From disk rather than from the
    engine's own parameters: they are the trainer's frozen base exactly (no rounding to a lower
    serving dtype before the merge), both engines merge the very same tensors, and nothing a
    server loaded earlier (a full-weight sync, a previous merge) can leak into them.

    `fallback(name)` supplies a tensor the checkpoint does not hold (a directory without
    safetensors): the hf engine snapshots its own parameter, which is still the base one as long
    as no merge has written it (the snapshot is taken before the first merge into it)."""

    def __init__(self, model_dir: str, fallback: Callable[[str], torch.Tensor | None] | None = None):
        self.model_dir = model_dir
        self.fallback = fallback
        self._cache: dict[str, torch.Tensor] = {}

    def get(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        names = list(names)
        missing = [n for n in names if n not in self._cache]
        if missing:
            self._cache.update(read_checkpoint(self.model_dir, missing))
            for n in missing:
                if n not in self._cache and self.fallback is not None:
                    t = self.fallback(n)
                    if t is not None:
                        self._cache[n] = t
        absent = [n for n in names if n not in self._cache]
        if absent:
            raise ValueError(f"the base model's {_few(absent)} is not in {self.model_dir}")
        return {n: self._cache[n] for n in names}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._cache.values())


# --- vLLM: completing the layers a merge reloads -------------------------------------------------
@dataclass(frozen=True)
class ReloadGroup:
    """One vLLM layer a merged adapter touches and every HF tensor that fills it."""

    layer: str
    """vLLM's module name (model.layers.0.self_attn.qkv_proj)."""
    tensors: tuple[str, ...]
    """HF names of all its parameters: the adapted modules' merged weights, and the base
    weights of its other parts (an untargeted k_proj beside q_proj, v_proj) and of its biases."""


def vllm_layer(module: str, packed: Mapping[str, Sequence[str]]) -> tuple[str, tuple[str, ...]]:
    """The vLLM layer an HF module loads into and the HF modules that make it up, e.g.
    model.layers.0.self_attn.q_proj -> (…self_attn.qkv_proj, (…q_proj, …k_proj, …v_proj))."""
    parent, _, leaf = module.rpartition(".")
    prefix = f"{parent}." if parent else ""
    for fused, parts in packed.items():
        if leaf in parts:
            return prefix + fused, tuple(prefix + p for p in parts)
    return module, (module,)


def reload_groups(
    modules: Iterable[str], packed: Mapping[str, Sequence[str]], base_names: Iterable[str]
) -> list[ReloadGroup]:
    """The vLLM layers that merged weights for `modules` touch, each with every HF tensor that
    fills it, in decoder-layer order.

    vLLM's layerwise reload puts a layer back on the meta device and processes it once the
    elements loaded reach the layer's size; a layer still short at the end is materialised
    uninitialised (torch.empty) and processed as it is. So loading only q_proj and v_proj into a
    fused qkv_proj, or a weight without its bias, would serve garbage for the rest: every tensor
    of every touched layer must be sent, the untargeted ones as the base model has them."""
    params: dict[str, list[str]] = {}
    for name in base_names:
        module, _, param = name.rpartition(".")
        params.setdefault(module, []).append(name)
    groups: dict[str, ReloadGroup] = {}
    for module in modules:
        layer, parts = vllm_layer(module, packed)
        if layer not in groups:
            groups[layer] = ReloadGroup(layer, tuple(n for p in parts for n in params.get(p, [])))
    # Decoder-layer order, so each layer completes (and frees its merged tensors) before the next.
    order = {layer: i for i, layer in enumerate(groups)}
    return sorted(groups.values(), key=lambda g: (_layer_index(g.layer), order[g.layer]))


def _layer_index(name: str) -> int:
    i = layer_of(name)
    return int(i) if i is not None else -1


# --- vLLM: serving adapters --------------------------------------------------------------------
def vllm_lora_args(rank: int, target_modules: Sequence[str]) -> dict[str, Any]:
    """vLLM engine arguments for serving the trainer's adapters (spec.trainer.lora.serveAs
    adapter). The target modules restrict which layers get LoRA kernels (vLLM maps q_proj to its
    fused qkv_proj itself); all-linear leaves it to vLLM (every layer it supports)."""
    return {
        "enable_lora": True,
        "max_lora_rank": vllm_max_lora_rank(rank),
        "max_loras": VLLM_ADAPTER_SLOTS,
        "max_cpu_loras": VLLM_CPU_ADAPTERS,
        "lora_target_modules": None if ALL_LINEAR in target_modules else list(target_modules),
    }


def adapters_to_retire(in_use: Collection[int], capacity: int = VLLM_CPU_ADAPTERS) -> list[int]:
    """Adapter ids (oldest first; ids grow with each version) whose requests must be aborted so
    that `in_use` plus the adapter about to arrive fit `capacity`."""
    excess = len(in_use) + 1 - capacity
    return sorted(in_use)[: max(excess, 0)]


def _few(names: Iterable[str], k: int = 3) -> str:
    names = list(names)
    more = f" and {len(names) - k} more" if len(names) > k else ""
    return ", ".join(names[:k]) + more
