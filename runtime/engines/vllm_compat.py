"""Every vLLM name outside vLLM's public API that kubedistill uses, in one place.

vLLM's public API is what the `vllm` package exports at its top level (SamplingParams,
RequestOutput, AsyncEngineArgs, ...) and `vllm.lora.request.LoRARequest`. Anything else may
change in any minor release. The engine (vllm_engine.py) and the worker extension
(vllm_worker.py) reach what they need of the rest only through this module. Each entry of PINNED
names one such symbol, says why we use it and which upstream file defines it, and gives the call
we make. tests/test_vllm_compat.py imports each entry and binds that call to its signature on
the installed vLLM. It also checks that this module imports nothing PINNED leaves out, and that
no other product module imports vLLM outside its public API. pyproject.toml pins the `vllm` extra
to TESTED_MINOR, so an upgrade is a deliberate change that runs this test first.

Imports are made inside the functions, so this module loads without vLLM, and the engine's
process never loads the worker's internals (the layerwise reload pulls in vLLM's model layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    # Annotations only (vLLM is typed as Any, pyproject.toml), re-exported for the two modules.
    from vllm.config import ModelConfig as ModelConfig
    from vllm.config import VllmConfig as VllmConfig
    from vllm.v1.engine.async_llm import AsyncLLM as AsyncLLM
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as GPUModelRunner

TESTED_MINOR = "0.32"
"""The vLLM minor this module was checked against (pyproject.toml: vllm>=0.32,<0.33)."""

RELOAD = "vllm.model_executor.model_loader.reload"


@dataclass(frozen=True)
class Pinned:
    """One vLLM symbol outside the public API. `path` is "module:Qualified.name". `positional`
    and `keywords` give the call we make: the number of positional arguments (`self` counted
    for a method looked up on its class) and the keyword names; None: we do not call it. `attrs`:
    attributes we read or set on it or on its instances."""

    path: str
    why: str
    upstream: str
    positional: int | None = None
    keywords: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()


PINNED: tuple[Pinned, ...] = (
    # --- the engine (vllm_engine.py) --------------------------------------------------------
    Pinned(
        "vllm.v1.engine.async_llm:AsyncLLM.from_engine_args",
        "the V1 async engine; its top-level name AsyncLLMEngine is only a back-compat alias",
        "vllm/v1/engine/async_llm.py",
        positional=1,
        attrs=("model_config", "vllm_config", "renderer", "engine_core"),
    ),
    Pinned(
        "vllm.v1.engine.async_llm:AsyncLLM.collective_rpc",
        "every worker-extension call (kd_ws_*) goes through it",
        "vllm/v1/engine/async_llm.py",
        positional=2,
        keywords=("args",),
    ),
    Pinned(
        "vllm.v1.engine.async_llm:AsyncLLM.pause_generation",
        "pause_scheduler re-implements its body without the closing 20 ms sleep (the test compares)",
        "vllm/v1/engine/async_llm.py",
        positional=1,
        keywords=("mode", "clear_cache"),
    ),
    Pinned(
        "vllm.v1.engine.core_client:AsyncMPClient.pause_scheduler_async",
        "what pause_generation calls on AsyncLLM.engine_core, called by pause_scheduler",
        "vllm/v1/engine/core_client.py",
        positional=1,
        keywords=("mode", "clear_cache"),
    ),
    Pinned(
        "vllm.renderers.base:BaseRenderer.clear_mm_cache_async",
        "what pause_generation calls on AsyncLLM.renderer before a pause that clears caches",
        "vllm/renderers/base.py",
        positional=1,
    ),
    Pinned(
        "vllm.config:VllmConfig.use_v2_model_runner",
        "only the V2 model runner scores given ids (prompt_logprob_token_ids); V1 returns all",
        "vllm/config/vllm.py",
    ),
    # --- the worker extension (vllm_worker.py) ----------------------------------------------
    Pinned(
        "vllm.config:set_current_vllm_config",
        "vLLM's own weight updates load inside the engine's config, which quantized layers read",
        "vllm/config/vllm.py",
        positional=1,
    ),
    Pinned(
        "vllm.distributed:get_tensor_model_parallel_rank",
        "a worker's tensor-parallel rank: its place in the weight-sync group",
        "vllm/distributed/parallel_state.py",
        positional=0,
    ),
    Pinned(
        f"{RELOAD}:initialize_layerwise_reload",
        "plain load_weights fails once vLLM-CPU repacked the linear layers; this reload restores them",
        "vllm/model_executor/model_loader/reload/layerwise.py",
        positional=1,
    ),
    Pinned(
        f"{RELOAD}:finalize_layerwise_reload",
        "ends the layerwise reload: re-processes (repacks) layers and puts unsent ones back",
        "vllm/model_executor/model_loader/reload/layerwise.py",
        positional=2,
    ),
    Pinned(
        f"{RELOAD}.layerwise:finalize_layerwise_processing",
        "what finalize_layerwise_reload(*args, **kwargs) forwards to: the signature our call must fit",
        "vllm/model_executor/model_loader/reload/layerwise.py",
        positional=2,
    ),
    Pinned(
        f"{RELOAD}.layerwise:get_layerwise_info",
        "a layer's reload state, for begin_layer_reload's copied loop and abandon_layer_reload",
        "vllm/model_executor/model_loader/reload/layerwise.py",
        positional=1,
    ),
    Pinned(
        f"{RELOAD}.layerwise:initialize_online_processing",
        "in initialize_layerwise_reload's loop body, which begin_layer_reload copies",
        "vllm/model_executor/model_loader/reload/layerwise.py",
        positional=1,
    ),
    Pinned(
        f"{RELOAD}.meta:restore_layer_on_meta",
        "in initialize_layerwise_reload's loop body, which begin_layer_reload copies",
        "vllm/model_executor/model_loader/reload/meta.py",
        positional=2,
    ),
    Pinned(
        f"{RELOAD}.utils:get_layer_params_buffers",
        "in initialize_layerwise_reload's loop body, which begin_layer_reload copies",
        "vllm/model_executor/model_loader/reload/utils.py",
        positional=1,
    ),
    Pinned(
        f"{RELOAD}.types:LayerReloadingInfo",
        "the state begin_layer_reload sets up and abandon_layer_reload resets for partly sent layers",
        "vllm/model_executor/model_loader/reload/types.py",
        attrs=("can_load", "load_numel", "loaded_weights", "kernel_tensors", "kernel_non_persistent_buffers"),
    ),
    Pinned(
        "vllm.config:ModelConfig",
        "the worker reads the checkpoint's path, the dtype and the HF config from it",
        "vllm/config/model.py",
        attrs=("model", "dtype", "hf_config"),
    ),
    Pinned(
        "vllm.model_executor.layers.quantization.base_config:QuantizeMethodBase.process_weights_after_loading",
        "re-processes a tied lm_head, which the layerwise reload leaves stale (_kd_refresh_tied_lm_head)",
        "vllm/model_executor/layers/quantization/base_config.py",
        positional=2,
    ),
    Pinned(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_model",
        "the model the worker computes with, and its lora_manager (vLLM-CPU's runner inherits both)",
        "vllm/v1/worker/gpu_model_runner.py, lora_model_runner_mixin.py",
        positional=1,
        attrs=("lora_manager",),
    ),
    Pinned(
        "vllm.lora.worker_manager:WorkerLoRAManager",
        "add_lora loads adapters from a directory only; ours arrive in memory (private manager)",
        "vllm/lora/worker_manager.py",
        attrs=("_adapter_manager", "lora_config", "vocab_size", "max_position_embeddings"),
    ),
    Pinned(
        "vllm.lora.model_manager:LoRAModelManager.add_adapter",
        "registers the in-memory adapter (packs q/k/v, folds the scale into B)",
        "vllm/lora/model_manager.py",
        positional=2,
        attrs=("model", "modules"),
    ),
    Pinned(
        "vllm.lora.model_manager:LoRAModelManager.remove_adapter",
        "drops adapters no request uses before vLLM's LRU evicts one (it would reload it from disk)",
        "vllm/lora/model_manager.py",
        positional=2,
    ),
    Pinned(
        "vllm.lora.model_manager:LoRAModelManager.list_adapters",
        "the adapter ids registered, to drop the unused ones",
        "vllm/lora/model_manager.py",
        positional=1,
    ),
    Pinned(
        "vllm.lora.peft_helper:PEFTHelper.from_dict",
        "the adapter's config without an adapter_config.json on disk",
        "vllm/lora/peft_helper.py",
        positional=1,
        attrs=("vllm_lora_scaling_factor", "validate_legal"),
    ),
    Pinned(
        "vllm.lora.lora_model:LoRAModel.from_lora_tensors",
        "the adapter from tensors in memory, as WorkerLoRAManager._load_adapter does from a directory",
        "vllm/lora/lora_model.py",
        positional=3,
        keywords=("device", "dtype", "model_vocab_size", "weights_mapper", "skip_prefixes"),
        attrs=("loras",),
    ),
    Pinned(
        "vllm.model_executor.models.utils:WeightsMapper.get_rename_mapper",
        "a model's HF->vLLM renames, for the adapter's names and for reading weights back as HF's",
        "vllm/model_executor/models/utils.py",
        positional=1,
        attrs=("orig_to_new_prefix",),
    ),
)


# --- the engine -------------------------------------------------------------------------------
def start_async_llm(engine_args: Any) -> AsyncLLM:
    """AsyncLLM.from_engine_args: the V1 engine, its engine core in a process of its own."""
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(engine_args)


async def pause_scheduler(llm: AsyncLLM, mode: str, clear_cache: bool) -> None:
    """AsyncLLM.pause_generation's body without its closing 20 ms sleep, which the engine waits
    out while the weights travel (vllm_engine.PAUSE_SETTLE_SECONDS)."""
    if clear_cache:
        await llm.renderer.clear_mm_cache_async()
    await llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)


def uses_v2_model_runner(llm: AsyncLLM) -> bool:
    return bool(llm.vllm_config.use_v2_model_runner)


# --- the worker extension ---------------------------------------------------------------------
def current_vllm_config(vllm_config: VllmConfig) -> AbstractContextManager[Any]:
    from vllm.config import set_current_vllm_config

    cm: AbstractContextManager[Any] = set_current_vllm_config(vllm_config)
    return cm


def tensor_parallel_rank() -> int | None:
    """This worker's tensor-parallel rank; None where vLLM formed no tensor-parallel group."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError):
        return None


def begin_layer_reload(model: torch.nn.Module, layers: Sequence[str] | None = None) -> None:
    """initialize_layerwise_reload, for the named layers only when `layers` is given (the whole
    model when one is not found under its name). finalize_layer_reload then leaves every other
    layer as it is, where a reload of the whole model would log "Failed to load weights" for each
    layer not sent. From the torchao lines on, this is initialize_layerwise_reload's body with
    its loop over the named layers (tests/test_vllm_compat.py compares the two)."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info, initialize_online_processing
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    named = dict(model.named_modules()) if layers is not None else {}
    if layers is None or any(name not in named for name in layers):
        initialize_layerwise_reload(model)
        return
    model._original_do_torchao_reload = getattr(model, "_do_torchao_reload", False)
    model._do_torchao_reload = False
    for layer in (named[name] for name in layers):
        info = get_layerwise_info(layer)
        if info.can_load():
            continue
        info.kernel_tensors = get_layer_params_buffers(layer)
        info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
        restore_layer_on_meta(layer, info)
        initialize_online_processing(layer)


def finalize_layer_reload(model: torch.nn.Module, model_config: ModelConfig) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


def abandon_layer_reload(model: torch.nn.Module, model_config: ModelConfig) -> None:
    """End a reload whose weights stopped arriving: a layer received in part is reset to none
    received, so finalize puts its old tensors back, as it does for a layer that got nothing."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.can_load() and info.load_numel > 0:
            info.load_numel = 0
            info.loaded_weights.clear()
    finalize_layer_reload(model, model_config)


def lora_managers(model_runner: GPUModelRunner) -> tuple[Any, Any] | None:
    """The worker's WorkerLoRAManager and the LoRAModelManager it keeps in `_adapter_manager`;
    None when the engine was started without LoRA (enable_lora)."""
    workers = getattr(model_runner, "lora_manager", None)
    if workers is None:
        return None
    return workers, workers._adapter_manager


def lora_model(
    workers: Any,
    manager: Any,
    adapter_id: int,
    tensors: dict[str, torch.Tensor],
    *,
    rank: int,
    scale: float,
    target_modules: Sequence[str],
) -> Any:
    """A LoRAModel built from tensors in memory, with WorkerLoRAManager._load_adapter's checks
    and name mapping, its scale exactly `scale` (not alpha / rank recomputed)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict(
        {
            "r": rank,
            "lora_alpha": scale * rank,
            "target_modules": list(target_modules),
            "vllm_max_position_embeddings": workers.max_position_embeddings,
        }
    )
    helper.vllm_lora_scaling_factor = scale
    helper.validate_legal(workers.lora_config)
    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return LoRAModel.from_lora_tensors(
        adapter_id,
        tensors,
        helper,
        device="cpu",
        dtype=workers.lora_config.lora_dtype,
        model_vocab_size=workers.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
