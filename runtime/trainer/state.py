"""The trainer's durable state: checkpoints (model, optimiser, LR scheduler, RNG, step count, the
driver's opaque state), resume from the newest one, and export of the student as an HF directory.
A LoRA student checkpoints its adapters (and their optimiser state) only, never the frozen base,
and exports a merged HF model or a PEFT adapter folder (spec.trainer.lora.export).

Each operation is collective: rank 0 calls the method named for it and gets the result; the other
ranks call its ``join_*`` twin, which runs the same collectives. Full (unsharded) state dicts are
gathered to rank 0's CPU; only rank 0 touches the filesystem. On-disk layout: runtime/checkpoint.py.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kubedistill.api.spec import DistillationJobSpec, LoraExport, ResumePolicy
from kubedistill.runtime.checkpoint import CheckpointInfo, CheckpointStore, read_pickle, write_pickle
from kubedistill.runtime.trainer.distributed import Ranks
from kubedistill.runtime.trainer.lora import is_adapter_param, lora_config, wire_name
from kubedistill.runtime.trainer.model import LM_PREFIX, LogProbModel, lora_adapter

TRAINER_FILE = "trainer.pt"
DRIVER_FILE = "driver.pkl"


@dataclass
class Resumed:
    step: int
    weight_version: int
    driver_state: Any
    path: Path


def rng_state(device: torch.device) -> dict[str, Any]:
    """The RNG states a checkpoint keeps: torch's, Python's, and the GPU's on cuda."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"])


class TrainerState:
    """Checkpoints, resume and HF export of one trainer rank's model, optimiser and scheduler."""

    def __init__(
        self,
        spec: DistillationJobSpec,
        ranks: Ranks,
        model: LogProbModel,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        model_path: Path,
    ):
        self.spec = spec
        self.ranks = ranks
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.model_path = model_path
        """The student's HF directory: the export copies its generation config (and tokenizer)."""
        self.store = CheckpointStore(spec.checkpoint.path, keep=spec.checkpoint.keep)

    # ---- checkpoint ----------------------------------------------------------------------------

    def save(self, step: int, weight_version: int, step_count: int, driver_state: Any) -> Path:
        """Rank 0: write checkpoint `step` atomically; returns its directory."""
        model_sd, optim_sd = self._gather_full_state()
        state = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "step_count": step_count,
            "rng": rng_state(self.ranks.device),
        }

        def write_trainer(p: Path) -> None:
            torch.save(state, p)

        path = self.store.save(
            step,
            weight_version,
            {TRAINER_FILE: write_trainer, DRIVER_FILE: write_pickle(driver_state)},
            {"world_size": self.ranks.world},
        )
        self.ranks.barrier()
        return path

    def join_save(self) -> None:
        """Ranks > 0: the collectives of :meth:`save`."""
        self._gather_full_state()
        self.ranks.barrier()

    def _gather_full_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        model_sd = self._full_model_state()
        optim_sd: dict[str, Any] = get_optimizer_state_dict(
            self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return model_sd, optim_sd

    def _full_model_state(self) -> dict[str, torch.Tensor]:
        """The model's full state on rank 0's CPU: every weight, or with LoRA the adapters only."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        lora = self.model.lora is not None
        sd: dict[str, torch.Tensor] = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora)
        )
        if lora:
            # ignore_frozen_params still returns a tied lm_head (it shares the embedding's
            # parameter object only by name): keep what PEFT trains.
            sd = {k: v for k, v in sd.items() if is_adapter_param(k)}
        return sd

    # ---- resume --------------------------------------------------------------------------------

    def resume(self) -> tuple[Resumed, int] | None:
        """Rank 0: load the newest complete checkpoint if spec.checkpoint.resume is auto (partial
        ones are removed first). Returns it and the restored optimiser step count, or None (start
        fresh)."""
        self.store.remove_partial()
        info = self.store.latest() if self.spec.checkpoint.resume is ResumePolicy.auto else None
        state = torch.load(info.path / TRAINER_FILE, weights_only=False) if info is not None else None
        mismatch = self._kind_mismatch(state["model"]) if state is not None else None
        self.ranks.broadcast_object(state is not None and mismatch is None)
        if mismatch is not None:
            raise ValueError(mismatch)
        if info is None or state is None:
            return None
        step_count = self._load(state)
        return _resumed(info), step_count

    def _kind_mismatch(self, model_sd: dict[str, Any]) -> str | None:
        """Why a checkpoint cannot resume this spec's model (LoRA adapters vs full weights)."""
        adapters = bool(model_sd) and all(is_adapter_param(k) for k in model_sd)
        if adapters == (self.model.lora is not None):
            return None
        held, wanted = ("LoRA adapters", "full weights") if adapters else ("full weights", "LoRA adapters")
        return (
            f"spec.trainer.lora: the newest checkpoint in {self.store.root} holds {held}, this job "
            f"trains {wanted}; point spec.checkpoint.path elsewhere or set checkpoint.resume: never"
        )

    def join_resume(self) -> int | None:
        """Ranks > 0: the collectives of :meth:`resume`; the restored step count, or None."""
        if not self.ranks.broadcast_object(None):
            return None
        return self._load({})

    def _load(self, state: dict[str, Any]) -> int:
        """Restore from rank 0's `state` (empty elsewhere): model and optimiser shards, then the
        scheduler, RNG states and step count broadcast to every rank."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # LoRA: the checkpoint holds the adapters only; the frozen base is the one just loaded.
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=self.model.lora is None)
        set_model_state_dict(self.model, state.get("model", {}), options=opts)
        set_optimizer_state_dict(self.model, self.optimizer, state.get("optimizer", {}), options=opts)
        small = self.ranks.broadcast_object(
            {k: state[k] for k in ("scheduler", "step_count", "rng")} if self.ranks.rank == 0 else None
        )
        self.scheduler.load_state_dict(small["scheduler"])
        set_rng_state(small["rng"], self.ranks.device)
        step_count: int = small["step_count"]
        return step_count

    # ---- HF export -----------------------------------------------------------------------------

    def export(self, out_dir: Path) -> Path:
        """Rank 0: write the student as a plain HF directory (safetensors, config, tokenizer;
        a vision-language student's processor too) loadable by transformers and vLLM, or with
        LoRA export: adapter a PEFT adapter folder; written to a temp dir, then renamed to
        `out_dir`."""
        from transformers import AutoProcessor, AutoTokenizer

        tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        sd = self._full_model_state()
        lora = self.model.lora
        if lora is not None and lora.export is LoraExport.adapter:
            self._write_adapter(sd, tmp)
        else:
            self._write_model(self._merged(sd) if lora is not None else sd, tmp)
        tok_src = self.spec.student.tokenizer or self.model_path
        if self.model.vision is not None:
            # The image processor (and chat template) that made the student's image inputs; the
            # tokenizer written next is the job's, as for a text student.
            remote = self.spec.student.trust_remote_code
            processor = AutoProcessor.from_pretrained(
                str(self.model_path), local_files_only=True, trust_remote_code=remote
            )
            processor.save_pretrained(str(tmp))
        AutoTokenizer.from_pretrained(str(tok_src), local_files_only=True).save_pretrained(str(tmp))
        gen = self.model_path / "generation_config.json"
        if gen.is_file():
            shutil.copy(gen, tmp / gen.name)
        _readable_by_all(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
        self.ranks.barrier()
        return out_dir

    def _write_adapter(self, sd: dict[str, torch.Tensor], tmp: Path) -> None:
        """A PEFT adapter folder (adapter_config.json naming the base model's directory, and
        adapter_model.safetensors under PEFT's saved names): what PeftModel.from_pretrained and
        vLLM's LoRARequest load."""
        from safetensors.torch import save_file

        adapter = lora_adapter(self.model)
        assert adapter is not None and self.model.lora is not None
        config = lora_config(self.model.lora, adapter.target_modules)
        config.base_model_name_or_path = str(self.model_path.resolve())
        config.save_pretrained(str(tmp))
        tensors = {f"base_model.model.{wire_name(k)}": v.contiguous() for k, v in sd.items()}
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})

    def _merged(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The base model from disk with the adapters in `sd` merged into it by PEFT, as a plain
        HF state dict under LM_PREFIX."""
        from peft import get_peft_model, set_peft_model_state_dict

        from kubedistill.runtime.models.loading import load_causal_lm

        adapter = lora_adapter(self.model)
        assert adapter is not None and self.model.lora is not None
        remote = self.spec.student.trust_remote_code
        base = load_causal_lm(self.model_path, dtype="float32", what="spec.student.model", trust_remote_code=remote)
        peft_model = get_peft_model(base, lora_config(self.model.lora, adapter.target_modules))
        result: Any = set_peft_model_state_dict(
            peft_model, {f"base_model.model.{wire_name(k)}": v for k, v in sd.items()}
        )
        unexpected = sorted(result.unexpected_keys)
        if unexpected:
            raise RuntimeError(f"export: adapter tensors PEFT did not expect: {unexpected[:3]}")
        merged = peft_model.merge_and_unload()
        return {LM_PREFIX + k: v for k, v in merged.state_dict().items()}

    def _write_model(self, sd: dict[str, torch.Tensor], tmp: Path) -> None:
        from kubedistill.runtime.models.loading import auto_model_class

        sd = {k[len(LM_PREFIX) :]: v for k, v in sd.items()}
        hf_config = self.model.lm.config
        fresh = auto_model_class(hf_config).from_config(hf_config, dtype=torch.float32)
        result = fresh.load_state_dict(sd, strict=False)
        tied = {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()
        if result.unexpected_keys or set(result.missing_keys) - tied:
            raise RuntimeError(
                f"export: state dict does not match {type(fresh).__name__}: missing "
                f"{sorted(set(result.missing_keys) - tied)}, unexpected {sorted(result.unexpected_keys)}"
            )
        fresh.save_pretrained(str(tmp), safe_serialization=True)

    def join_export(self) -> None:
        """Ranks > 0: the collectives of :meth:`export`."""
        self._full_model_state()
        self.ranks.barrier()


def _readable_by_all(directory: Path) -> None:
    """The exported model is for other pods (serving, evaluation) that may run as another uid on
    the shared claim; safetensors writes its file 0600 (through a temp file)."""
    directory.chmod(0o755)
    for f in directory.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)


def _resumed(info: CheckpointInfo) -> Resumed:
    return Resumed(info.step, info.weight_version, read_pickle(info.path / DRIVER_FILE), info.path)
