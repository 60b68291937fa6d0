"""Methods merged into every vLLM worker (`worker_extension_cls`), called with collective_rpc.

Names carry a `kd_` prefix: vLLM refuses to start if an extension method shadows a worker
attribute (update_weights, reload_weights, start_weight_update, ...). The weight load follows
vLLM's layerwise reload (initialize -> load_weights per bucket -> finalize) because plain
load_weights fails after the CPU backend has repacked the linear layers, then re-processes a
tied lm_head, which that sequence leaves stale without any error.

A LoRA manifest (runtime/weight_sync/lora.py) travels through the same receive; then either the
merged weights W0 + scale * B @ A of the layers it touches are fed to that same reload (merged),
or the adapter is registered with the worker's LoRA manager under the id the engine gives each
version (adapter; the engine's requests name it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kubedistill.runtime.engines import vllm_compat

if TYPE_CHECKING:
    from kubedistill.runtime.engines.vllm_compat import GPUModelRunner, ModelConfig, VllmConfig
    from kubedistill.runtime.weight_sync.group import WeightSyncGroup
    from kubedistill.runtime.weight_sync.lora import BaseWeights
    from kubedistill.runtime.wire.protocol import LoraAdapter, Manifest


LEAVE_WAIT_SECONDS = 30.0
"""How long leaving waits for an aborted transfer to end: a wait on the group ends at once, but a
load or the closing repack in progress runs to its end first."""


@dataclass
class _Task:
    """A weight transfer running in its own worker thread."""

    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, float] | None = None
    error: str | None = None


def worker_member(
    base_rank: int, tp_rank: int | None, tp_size: int, backend: str, device: torch.device | str | None
) -> tuple[int, str | None]:
    """A vLLM worker's (rank, device) in the weight-sync group: its server's first rank plus its
    tensor-parallel rank, and on NCCL the worker's own GPU, named because the join runs in a new
    thread whose current device is cuda:0 whatever GPU the worker drives."""
    from kubedistill.runtime.weight_sync.group import sync_rank

    return sync_rank(base_rank, tp_rank, tp_size), (str(device) if backend == "nccl" and device is not None else None)


class WeightSyncWorkerExtension:
    if TYPE_CHECKING:
        # Attributes of the vLLM worker this class is merged into. Declared for the type checker
        # only: vLLM refuses an extension whose attributes overlap the worker's.
        model_runner: GPUModelRunner
        model_config: ModelConfig
        vllm_config: VllmConfig

    _kd_group: WeightSyncGroup | None = None
    _kd_state = "none"
    _kd_error: str | None = None
    _kd_epoch: str | None = None
    _kd_task: _Task | None = None
    _kd_lora_base: BaseWeights | None = None
    _kd_checkpoint_names: list[str] = []
    _kd_base_copy: dict[str, torch.Tensor] | None = None
    """The delta base: every tensor as last loaded by a sync that keeps one (see _kd_receive_delta)."""

    # --- group --------------------------------------------------------------------------------
    def kd_ws_join(
        self,
        host: str,
        port: int,
        base_rank: int,
        world_size: int,
        backend: str,
        timeout_seconds: float,
        epoch: str = "0",
    ) -> None:
        """Join in a thread: the rendezvous waits for the trainer, and the worker must keep serving."""
        from kubedistill.runtime.weight_sync.group import GroupAddress, WeightSyncGroup

        tp_rank = vllm_compat.tensor_parallel_rank()  # None: sync_rank allows that only without TP
        tp_size = getattr(getattr(self, "parallel_config", None), "tensor_parallel_size", 1)
        rank, device = worker_member(base_rank, tp_rank, tp_size, backend, getattr(self, "device", None))
        addr = GroupAddress(host, port, rank, world_size, backend, timeout_seconds, epoch, device=device)
        self._kd_state = "joining"
        self._kd_error = None
        self._kd_epoch = epoch

        def join() -> None:
            try:
                group = WeightSyncGroup(addr)
            except Exception as e:
                if self._kd_epoch == epoch:
                    self._kd_error = f"{type(e).__name__}: {e}"
                    self._kd_state = "failed"
                return
            if self._kd_epoch != epoch:  # superseded while joining (kd_ws_leave ran meanwhile)
                group.close()
                return
            self._kd_group = group
            self._kd_state = "ready"

        threading.Thread(target=join, name="kd-weight-sync-join", daemon=True).start()

    def kd_ws_state(self) -> tuple[str, str | None]:
        return self._kd_state, self._kd_error

    def kd_ws_abort(self) -> None:
        """Break off a receive blocked on the current group (its trainer is gone). Returns at once:
        the receive runs in its own thread (kd_ws_receive_start), so this RPC is not queued
        behind it, and its end is read with kd_ws_task_poll."""
        group = self._kd_group
        if group is not None:
            group.abort()

    def kd_ws_leave(self) -> None:
        """Tear down the current group (the trainer re-forms it under a new epoch). A transfer
        still running on it is aborted and waited for; if it does not end, the group is left
        alone (its thread may still be inside it) and the state says `failed` with a message
        starting "wedged:", which the engine turns into GroupWedged."""
        group, self._kd_group = self._kd_group, None
        self._kd_epoch = None
        self._kd_state, self._kd_error = "none", None
        task = self._kd_task
        if group is not None:
            group.abort()
        if task is not None and not task.done.wait(LEAVE_WAIT_SECONDS):
            self._kd_state = "failed"
            self._kd_error = "wedged: a weight transfer did not end after its group was aborted"
            return
        if group is not None and group.wedged is not None:
            self._kd_state, self._kd_error = "failed", f"wedged: {group.wedged}"
            return
        if group is not None:
            group.close()

    # --- transfers (each in its own thread, so kd_ws_abort can reach it) -----------------------
    def _kd_start(self, name: str, work: Callable[[WeightSyncGroup], dict[str, float]]) -> None:
        group = self._kd_group
        if group is None:
            raise RuntimeError(f"not in the weight-sync group (state {self._kd_state})")
        if self._kd_task is not None and not self._kd_task.done.is_set():
            raise RuntimeError("a weight transfer is already running on this worker")
        task = _Task()
        self._kd_task = task

        def run() -> None:
            try:
                if group.device.type == "cuda":
                    torch.cuda.set_device(group.device)  # a new thread starts on cuda:0
                task.result = work(group)
            except BaseException as e:
                task.error = f"{type(e).__name__}: {e}"
            finally:
                task.done.set()

        threading.Thread(target=run, name=f"kd-weight-sync-{name}", daemon=True).start()

    def kd_ws_task_poll(self, wait: float = 0.0) -> tuple[str, dict[str, float] | str | None]:
        """The last transfer: ("running", None), ("done", stats) or ("failed", error); waits up to
        `wait` seconds for it to end, so the engine learns of the end as it happens rather than
        at its next poll (an abort RPC waits behind this one at most that long)."""
        task = self._kd_task
        if task is None:
            return "failed", "no weight transfer was started on this worker"
        if not task.done.wait(wait):
            return "running", None
        if task.error is not None:
            return "failed", task.error
        return "done", task.result

    def _kd_check_idle(self) -> None:
        if self._kd_task is not None and not self._kd_task.done.is_set():
            raise RuntimeError("a weight transfer is running; ask again once it has ended")

    # --- receive ------------------------------------------------------------------------------
    def kd_ws_receive_start(
        self, manifest_json: str, load: bool, adapter_id: int = 0, keep_adapters: Sequence[int] = ()
    ) -> None:
        """Receive a sync in a thread of its own. For an adapter to serve (serve_as adapter),
        `adapter_id` is the id it is registered under and `keep_adapters` the ids requests still
        use (every other registered adapter is dropped first)."""
        from kubedistill.runtime.wire.protocol import Manifest

        manifest = Manifest.model_validate_json(manifest_json)
        lora = manifest.lora
        if lora is None:
            self._kd_start("receive", lambda group: self._kd_receive(group, manifest, load))
        elif lora.serve_as == "merged":
            self._kd_start("receive", lambda group: self._kd_receive_lora(group, manifest, load, self._kd_merge_lora))
        else:

            def register(lora: LoraAdapter, tensors: dict[str, torch.Tensor]) -> None:
                self._kd_add_adapter(lora, tensors, adapter_id, keep_adapters)

            self._kd_start("receive", lambda group: self._kd_receive_lora(group, manifest, load, register))

    def _kd_receive(self, group: WeightSyncGroup, manifest: Manifest, load: bool) -> dict[str, float]:
        from kubedistill.runtime.weight_sync.delta import to_host
        from kubedistill.runtime.weight_sync.transfer import close_receive, receive

        if manifest.delta is not None and manifest.delta.base is not None:
            return self._kd_receive_delta(group, manifest, load)
        model = self.model_runner.get_model()
        errors: list[str] = []
        t0 = time.perf_counter()
        if load:
            self._kd_base_copy = None  # the weights no longer match it from here on
        # Keeping a delta base: a copy of every tensor as loaded (host memory, pinned from a GPU;
        # HF names, unfused). Only a sync that starts a chain asks for one (manifest.delta), and
        # only a job with weightSync.delta on sends such syncs: under never a worker keeps none.
        kept: dict[str, torch.Tensor] | None = {} if load and manifest.delta is not None else None

        def consume(named: list[tuple[str, torch.Tensor]]) -> None:
            if errors or not load:
                return
            try:
                if kept is not None:
                    kept.update((n, to_host(t)) for n, t in named)
                model.load_weights(weights=named)
            except Exception as e:  # keep receiving so the collective stays in step
                errors.append(f"{type(e).__name__}: {e}")

        # Inside the engine's config context, as vLLM's own weight updates run: quantized layers
        # read it while they (re)process loaded weights.
        with vllm_compat.current_vllm_config(self.vllm_config), torch.no_grad():
            if load:
                vllm_compat.begin_layer_reload(model)
            try:
                stats = receive(group, manifest, consume)
            except BaseException:
                if load:
                    self._kd_abandon_reload(model)
                raise
            t_fin = time.perf_counter()
            if load:
                vllm_compat.finalize_layer_reload(model, self.model_config)
                self._kd_refresh_tied_lm_head(model)
            finalize_s = time.perf_counter() - t_fin
        closed = close_receive(group, stats, errors, load, finalize_s)
        if load:
            self._kd_base_copy = kept
        return {**closed, "seconds": time.perf_counter() - t0, "repack_seconds": finalize_s}

    def _kd_receive_delta(self, group: WeightSyncGroup, manifest: Manifest, load: bool) -> dict[str, float]:
        """A delta: its pieces patch this worker's copy of the tensors it last loaded (unfused, HF
        names), then every tensor goes through the loader as in a full sync, so fused layers
        (qkv, gate_up) end exactly as a full sync of this version would leave them."""
        from kubedistill.runtime.weight_sync.delta import Assembler
        from kubedistill.runtime.weight_sync.delta import apply as apply_patch
        from kubedistill.runtime.weight_sync.transfer import close_receive, receive

        assert manifest.delta is not None
        model = self.model_runner.get_model()
        t0 = time.perf_counter()
        base = self._kd_base_copy
        if load:
            self._kd_base_copy = None  # until this load completes: a failed one leaves it patched halfway
        errors: list[str] = []
        if load and base is None:
            errors.append("RuntimeError: this worker keeps no copy of the delta's base (restarted?)")
        patches = Assembler(manifest.delta.targets)

        def consume(named: list[tuple[str, torch.Tensor]]) -> None:
            if errors or not load or base is None:
                return
            try:
                for name, t in named:
                    for target, positions, values in patches.add(name, t):
                        apply_patch(base[target], positions, values)
            except Exception as e:  # keep receiving so the collective stays in step
                errors.append(f"{type(e).__name__}: {e}")

        stats = receive(group, manifest, consume)
        t_fin = time.perf_counter()
        if load and not errors and base is not None:
            try:
                patches.check_done()
                with vllm_compat.current_vllm_config(self.vllm_config), torch.no_grad():
                    vllm_compat.begin_layer_reload(model)
                    try:
                        model.load_weights(weights=((t.name, base[t.name]) for t in manifest.delta.targets))
                    except BaseException:
                        self._kd_abandon_reload(model)
                        raise
                    vllm_compat.finalize_layer_reload(model, self.model_config)
                    self._kd_refresh_tied_lm_head(model)
            except Exception as e:  # reported through the all-reduce, like a failed load
                errors.append(f"{type(e).__name__}: {e}")
        load_s = time.perf_counter() - t_fin
        closed = close_receive(group, stats, errors, load, load_s)  # raises the first error
        if load:
            self._kd_base_copy = base
        return {**closed, "seconds": time.perf_counter() - t0, "repack_seconds": load_s}

    def _kd_receive_lora(
        self,
        group: WeightSyncGroup,
        manifest: Manifest,
        load: bool,
        apply: Callable[[LoraAdapter, dict[str, torch.Tensor]], None],
    ) -> dict[str, float]:
        """Receive a LoRA adapter's tensors (a few MiB: kept whole until the last bucket), then
        `apply` them; the failure all-reduce closes the sync as for full weights."""
        from kubedistill.runtime.weight_sync.transfer import close_receive, receive

        assert manifest.lora is not None
        errors: list[str] = []
        tensors: dict[str, torch.Tensor] = {}
        t0 = time.perf_counter()
        if load:
            self._kd_base_copy = None  # the merge changes the weights under it

        def consume(named: list[tuple[str, torch.Tensor]]) -> None:
            if load:
                # Copies: the views share their bucket's buffer, and vLLM scales lora_b in place.
                tensors.update((n, t.clone()) for n, t in named)

        stats = receive(group, manifest, consume)
        t_apply = time.perf_counter()
        if load:
            try:
                apply(manifest.lora, tensors)
            except Exception as e:  # reported through the all-reduce, like a failed load
                errors.append(f"{type(e).__name__}: {e}")
        apply_s = time.perf_counter() - t_apply
        return {**close_receive(group, stats, errors, load, apply_s), "seconds": time.perf_counter() - t0}

    def _kd_merge_lora(self, lora: LoraAdapter, tensors: dict[str, torch.Tensor]) -> None:
        """Load W0 + scale * B @ A for every adapted module through the layerwise reload, only
        for the layers the adapter touches, each completed with its other base tensors (see
        lora.reload_groups). W0 comes from the checkpoint on disk (lora.BaseWeights)."""
        from kubedistill.runtime.engines.vllm_engine import checkpoint_tensors
        from kubedistill.runtime.weight_sync.lora import BaseWeights, adapted_modules, merge, reload_groups

        model = self.model_runner.get_model()
        modules = adapted_modules(tensors)
        if self._kd_lora_base is None:
            self._kd_checkpoint_names = list(checkpoint_tensors(self.model_config.model))
            self._kd_lora_base = BaseWeights(self.model_config.model)
        groups = reload_groups(modules, getattr(model, "packed_modules_mapping", {}), self._kd_checkpoint_names)
        base = self._kd_lora_base.get(n for g in groups for n in g.tensors)
        merged_into = {m.weight: m for m in modules.values()}
        dtype = self.model_config.dtype
        device = next(model.parameters()).device

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            # Lazily, in layer order: a layer's merged tensors are freed once it is processed.
            for g in groups:
                for name in g.tensors:
                    m = merged_into.get(name)
                    if m is None:
                        yield name, base[name].to(device=device, dtype=dtype)
                    else:
                        a, b = tensors[m.a].to(device), tensors[m.b].to(device)
                        yield name, merge(base[name], a, b, lora.scale, dtype)

        with vllm_compat.current_vllm_config(self.vllm_config), torch.no_grad():
            # Only the layers the adapter touches: the others stay as they are, where a reload of
            # the whole model would log "Failed to load weights" for each layer not sent.
            vllm_compat.begin_layer_reload(model, [g.layer for g in groups])
            try:
                model.load_weights(weights=weights())
            except BaseException:
                self._kd_abandon_reload(model)
                raise
            vllm_compat.finalize_layer_reload(model, self.model_config)

    def _kd_add_adapter(
        self, lora: LoraAdapter, tensors: dict[str, torch.Tensor], adapter_id: int, keep: Sequence[int]
    ) -> None:
        """Register the adapter with the worker's LoRA manager under `adapter_id`, built in
        memory (no adapter directory). Adapters no request uses any more are dropped first, so
        vLLM's LRU never has to evict one: a request naming an evicted adapter makes vLLM load
        it from its (made-up) path, which kills the engine. It is activated when a request first
        names it."""
        managers = vllm_compat.lora_managers(self.model_runner)
        if managers is None:
            raise RuntimeError("this vLLM engine was started without LoRA (enable_lora); it cannot serve adapters")
        workers, manager = managers
        adapter = vllm_compat.lora_model(
            workers, manager, adapter_id, tensors, rank=lora.rank, scale=lora.scale, target_modules=lora.target_modules
        )
        for old in set(manager.list_adapters()) - set(keep):
            manager.remove_adapter(old)
        manager.add_adapter(adapter)  # packs q/k/v into qkv_proj and folds the scale into B
        ignored = sorted(set(adapter.loras) - set(manager.modules))
        if ignored:
            manager.remove_adapter(adapter_id)
            raise ValueError(
                f"vLLM has no LoRA layer for {', '.join(ignored[:3])}: the adapter would be ignored there "
                "(a module outside vLLM's LoRA support or the engine's lora target modules)"
            )

    def _kd_abandon_reload(self, model: torch.nn.Module) -> None:
        """Leave a layerwise reload whose receive broke off (aborted, or the trainer died). Until
        finalized, every layer not yet complete sits on the meta device and the next forward kills
        the engine. A layer the reload already completed keeps its new weights; every other one,
        partly received ones included, gets its old tensors back (finalize does that for a layer
        that received nothing, so the partial ones are reset to that). The engine then serves
        whole layers, some of the new version, until the next sync: the re-formed group's first
        one, sent as soon as the trainer is back."""
        vllm_compat.abandon_layer_reload(model, self.model_config)
        self._kd_refresh_tied_lm_head(model)

    def _kd_refresh_tied_lm_head(self, model: torch.nn.Module) -> None:
        if not getattr(self.model_config.hf_config, "tie_word_embeddings", False):
            return
        lm = language_model(model)  # a vision-language model's lm_head is its language model's
        lm_head = getattr(lm, "lm_head", None)
        embed = getattr(getattr(lm, "model", None), "embed_tokens", None)
        if lm_head is None or embed is None or not hasattr(lm_head, "quant_method"):
            return
        if lm_head.weight.numel() and lm_head.weight.data_ptr() != embed.weight.data_ptr():
            lm_head.weight.data.copy_(embed.weight.data)
        lm_head.quant_method.process_weights_after_loading(lm_head)

    def kd_weight_checksums(self) -> dict[str, str]:
        from kubedistill.runtime.weight_sync.manifest import tensor_checksum

        self._kd_check_idle()  # a load in progress would be read half old, half new
        # One weight at a time: the GPU holds one weight's copy at most, never a second model.
        return {n: tensor_checksum(t) for n, t in self._kd_effective_weights()}

    # --- inspection -----------------------------------------------------------------------------
    def _kd_effective_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights the engine actually computes with, under HF names, one at a time (views
        where possible: consume each before the next). Linear layers whose weights were packed
        into CPU kernels are read back by multiplying with the identity (exact in fp32: every
        product is by 1 or 0). Fused qkv/gate_up layers are split back into their HF parts by
        this worker's partition sizes (its shard under tensor parallelism). Includes
        `lm_head.weight` as used for logits."""
        model = self.model_runner.get_model()
        packed = getattr(model, "packed_modules_mapping", {})
        hf = hf_names(model)
        with torch.no_grad():
            for mname, module in model.named_modules():
                # With LoRA enabled, vLLM wraps each layer and keeps the original as `base_layer`.
                mname = mname.removesuffix(".base_layer")
                if mname == "lm_head" or mname.endswith(".lm_head"):
                    continue
                for pname, p in module.named_parameters(recurse=False):
                    full = f"{mname}.{pname}" if mname else pname
                    t = p.detach()
                    if pname == "weight" and t.numel() == 0 and hasattr(module, "cpu_linear"):
                        k = module.input_size_per_partition
                        eye = torch.eye(k, dtype=torch.float32, device=p.device).to(p.dtype)
                        t = module.cpu_linear(eye, p, None).t()
                    vocab = getattr(module, "org_vocab_size", None)
                    if vocab is not None and pname == "weight":
                        t = t[:vocab]  # vLLM pads the vocabulary rows
                    leaf = mname.rsplit(".", 1)[-1]
                    if packed.get(leaf, [leaf]) != [leaf]:  # a Qwen-VL tower's qkv is packed in HF too
                        sizes = list(getattr(module, "output_partition_sizes", module.output_sizes))
                        for sub, part in zip(packed[leaf], torch.split(t, sizes, dim=0)):
                            yield hf(f"{mname[: -len(leaf)]}{sub}.{pname}"), part.contiguous()
                    else:
                        yield hf(full), t
            lm = language_model(model)
            lm_head = getattr(lm, "lm_head", None)
            if lm_head is not None and hasattr(lm_head, "quant_method"):
                h = lm.config.hidden_size
                weight = lm_head.weight
                dtype = weight.dtype if weight.numel() else torch.float32
                eye = torch.eye(h, dtype=dtype, device=weight.device)
                w = lm_head.quant_method.apply(lm_head, eye).t()
                yield "lm_head.weight", w[: getattr(lm_head, "org_vocab_size", w.shape[0])].contiguous()


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding `lm_head` and `model.embed_tokens`: the model itself for a causal LM,
    its language model for a vision-language one (vLLM's Qwen-VL: `language_model`)."""
    get = getattr(model, "get_language_model", None)
    if getattr(model, "lm_head", None) is None and callable(get):
        lm: torch.nn.Module = get()
        return lm
    return model


def hf_names(model: torch.nn.Module) -> Callable[[str], str]:
    """vLLM's parameter names back to the checkpoint's HF names: the model's own
    `hf_to_vllm_mapper` prefixes reversed (a Qwen-VL's `visual.` -> `model.visual.`,
    `language_model.model.` -> `model.language_model.`, `language_model.lm_head.` -> `lm_head.`);
    unchanged for a model without them."""
    prefixes = getattr(getattr(model, "hf_to_vllm_mapper", None), "orig_to_new_prefix", None) or {}
    back = sorted(((new, orig) for orig, new in prefixes.items() if new), key=lambda p: -len(p[0]))

    def hf(name: str) -> str:
        for new, orig in back:
            if name.startswith(new):
                return f"{orig}{name[len(new) :]}"
        return name

    return hf
