"""Shared pieces of the CPU benchmarks in bench/: job files, running a job with every role as
local processes (`kubedistill run`), reading its per-step history and checkpoints, tables.

Nothing here fakes a measurement: every number comes from a job that really ran.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python bench/x.py` from a checkout without the package installed
    sys.path.insert(0, str(REPO))

MODES = ("sync", "oneStepOff", "fullyAsync")
API_VERSION = "kubedistill.io/v1alpha1"


@dataclass
class JobShape:
    """What varies between benchmark jobs; everything else is fixed by `job_manifest`."""

    name: str
    mode: str
    student: Path
    teacher: Path
    train: Path
    val: Path | None
    checkpoint: Path
    steps: int
    lr: float
    loss: str = "forwardKLTopK"
    policy_gradient: bool = False
    top_k: int = 16
    engine: str = "hf"
    n: int = 4
    max_tokens: int = 8
    mini_batch: int = 64
    checkpoint_every: int = 10
    warmup: int = 5
    max_model_len: int = 64
    async_: dict[str, Any] = field(default_factory=dict)
    loss_max_clamp: float | None = None
    seed: int | None = 0
    """rollout.sampling.seed (None: unseeded, which the engines sample in one batched draw)."""
    lora: dict[str, Any] | None = None
    """spec.trainer.lora (None: full fine-tuning)."""
    importance: dict[str, Any] | None = None
    """spec.algorithm.offPolicy.importance (None: the defaults)."""
    delta: str | None = None
    """spec.weightSync.delta.mode (None: the default, never)."""
    rollout_dtype: str = "auto"
    """spec.rollout.inference.dtype: what the rollout engine holds, and so what a weight sync
    sends (bfloat16: an update below half a bf16 ulp leaves the synced weight unchanged)."""


def job_manifest(s: JobShape) -> dict[str, Any]:
    """A DistillationJob for CPU: one rollout, one teacher, one trainer, one thread each."""
    inference: dict[str, Any] = {"engine": s.engine, "maxModelLen": s.max_model_len}
    if s.engine == "vllm":
        inference["kvCacheGiB"] = 1
    distillation: dict[str, Any] = {"lossMode": s.loss, "topK": s.top_k, "usePolicyGradient": s.policy_gradient}
    if s.loss_max_clamp is not None:
        distillation["lossMaxClamp"] = s.loss_max_clamp
    spec: dict[str, Any] = {
        "mode": s.mode,
        "device": "cpu",
        "student": {"model": str(s.student)},
        "teachers": [
            {"name": "teacher", "model": str(s.teacher), "inference": dict(inference), "overrides": {"cpuThreads": 1}}
        ],
        "rollout": {
            "replicas": 1,
            "inference": {**inference, **({"dtype": s.rollout_dtype} if s.rollout_dtype != "auto" else {})},
            "sampling": {
                "samplesPerPrompt": s.n,
                "temperature": 1.0,
                "maxTokens": s.max_tokens,
                **({"seed": s.seed} if s.seed is not None else {}),
            },
            "overrides": {"cpuThreads": 1},
        },
        "trainer": {
            "replicas": 1,
            "miniBatchSize": s.mini_batch,
            "totalSteps": s.steps,
            "mixedPrecision": "float32",
            "optim": {"lr": s.lr, "warmupSteps": s.warmup, "schedule": "cosine", "gradClip": 1.0},
            "overrides": {"cpuThreads": 1},
        },
        "algorithm": {"distillation": distillation},
        "data": {"train": [str(s.train)], "val": [str(s.val)] if s.val else [], "maxPromptLength": 32, "seed": 0},
        "checkpoint": {"path": str(s.checkpoint), "everySteps": s.checkpoint_every, "keep": 1000, "resume": "never"},
        "weightSync": {"bucketMB": 16, **({"delta": {"mode": s.delta}} if s.delta else {})},
    }
    if s.mode == "fullyAsync" or s.async_:
        spec["async"] = dict(s.async_)
    if s.lora is not None:
        spec["trainer"]["lora"] = dict(s.lora)
    if s.importance is not None:
        spec["algorithm"]["offPolicy"] = {"importance": dict(s.importance)}
    return {"apiVersion": API_VERSION, "kind": "DistillationJob", "metadata": {"name": s.name}, "spec": spec}


class JobFailed(RuntimeError):
    pass


# Where the roles run when pinned (bench --pin): the trainer (with the driver) on one core, the
# rollout and teacher servers on the other, like a trainer GPU pool next to an inference pool.
# Without pinning, three busy processes share two cores and the train step slows by ~1.6x
# whenever generation overlaps it.
PINNED = {"trainer": {0}, "rollout": {1}, "teacher": {1}}


class RolePinner:
    """Pins the role processes of one job (found by their `--config <dir>/config.json` command
    line) and every thread in them to `placement[role]` CPUs, re-checking every 0.2 s so threads
    started later are pinned too. Only processes of this benchmark's own job are touched."""

    def __init__(self, config_path: Path, placement: dict[str, set[int]]):
        import threading

        self.config = str(Path(config_path).resolve())
        self.placement = placement
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RolePinner:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            for pid_dir in Path("/proc").iterdir():
                if not pid_dir.name.isdigit():
                    continue
                try:
                    # as ps reads it: a forked role's command line is one string (setproctitle)
                    argv = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").split()
                except OSError:
                    continue
                words = [a.decode(errors="replace") for a in argv]
                if self.config not in words or "role" not in words:
                    continue
                role = words[words.index("role") + 1] if words.index("role") + 1 < len(words) else ""
                cpus = self.placement.get(role)
                if not cpus:
                    continue
                try:
                    for task in (pid_dir / "task").iterdir():
                        if os.sched_getaffinity(int(task.name)) != cpus:
                            os.sched_setaffinity(int(task.name), cpus)
                except OSError:
                    continue


def run_job(shape: JobShape, workdir: Path, log=print, pin: dict[str, set[int]] | None = None) -> dict[str, Any]:
    """Write the job file, run it with `kubedistill run` machinery and return its report
    (``history``: one entry per train step from trainer rank 0). `pin`: role -> CPUs (see PINNED)."""
    return run_manifest(job_manifest(shape), workdir, log, pin)


def run_manifest(
    manifest: dict[str, Any], workdir: Path, log=print, pin: dict[str, set[int]] | None = None
) -> dict[str, Any]:
    """run_job for a whole DistillationJob manifest (named by its metadata.name)."""
    import contextlib

    import yaml

    from kubedistill.runtime.entrypoints import local

    name = manifest["metadata"]["name"]
    workdir.mkdir(parents=True, exist_ok=True)
    job_path = workdir / f"{name}.yaml"
    job_path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    report_path = workdir / f"{name}.report.json"
    report_path.unlink(missing_ok=True)
    t0 = time.time()
    pinner = RolePinner(workdir / name / "config.json", pin) if pin else contextlib.nullcontext()
    with pinner:
        code = local.run(
            job_path,
            workdir=workdir / name,
            report=report_path,
            progress=False,
            log=lambda line: log(f"  [{name}] {line}"),
        )
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    report["launcherSeconds"] = round(time.time() - t0, 1)
    if code != 0 or not report.get("history"):
        raise JobFailed(
            f"job {name} failed ({report.get('result', f'exit {code}')}); logs in "
            f"{report.get('logs', workdir / name / 'logs')}"
        )
    return report


def history_at(history: Sequence[dict[str, Any]], step: int) -> dict[str, Any] | None:
    for h in history:
        if h.get("step") == step:
            return h
    return None


def load_checkpoint_student(init_dir: Path, checkpoint_dir: Path, lora: dict[str, Any] | None = None):
    """The student of a trainer checkpoint (`trainer.pt`) as a plain HF model; a LoRA job's
    checkpoint (adapters only, `lora` = its spec.trainer.lora) merged into the base at `init_dir`.
    A vision-language student (a `vision_config` in its config.json) loads as its
    AutoModelForImageTextToText, a text one as AutoModelForCausalLM."""
    import torch
    from transformers import AutoConfig

    from kubedistill.runtime.models.loading import auto_model_class

    model = auto_model_class(AutoConfig.from_pretrained(str(init_dir))).from_pretrained(str(init_dir))
    state = torch.load(checkpoint_dir / "trainer.pt", map_location="cpu", weights_only=False)["model"]
    if lora is not None:
        from kubedistill.api.spec import LoraSpec
        from kubedistill.runtime.trainer.lora import apply_lora

        peft_model = apply_lora(model, LoraSpec.model_validate(lora))
        result = peft_model.load_state_dict({k.removeprefix("lm."): v for k, v in state.items()}, strict=False)
        if result.unexpected_keys or not state:
            unexpected = result.unexpected_keys[:3]
            raise RuntimeError(f"checkpoint {checkpoint_dir}: adapters PEFT did not expect: {unexpected}")
        return peft_model.merge_and_unload().eval()
    # The trainer wraps the HF model as `lm` (see runtime/trainer/model.py).
    sd = {k[len("lm.") :] if k.startswith("lm.") else k: v for k, v in state.items()}
    result = model.load_state_dict(sd, strict=False)
    missing = set(result.missing_keys) - {"lm_head.weight"}
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"checkpoint {checkpoint_dir} does not match {init_dir}: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(result.unexpected_keys)[:3]}"
        )
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of the complete checkpoints under `root`, oldest first."""
    from kubedistill.runtime.checkpoint import CheckpointStore

    return sorted((c.step, c.path) for c in CheckpointStore(root, keep=1000).complete())


def mean(xs: Iterable[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def first_time_at_or_below(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first time a (time, value) curve reaches `target`, interpolated linearly between the
    two points around the crossing; None if it never does."""
    prev: tuple[float, float] | None = None
    for t, v in points:
        if v <= target:
            if prev is None or prev[1] == v:
                return t
            (t0, v0) = prev
            return t0 + (t - t0) * (v0 - target) / (v0 - v)
        prev = (t, v)
    return None


def fmt(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool = False) -> str:
    cells = [[str(c) for c in r] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells])
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def single_thread() -> None:
    """The benchmark process itself (evaluation, preparation) uses one thread: the roles already
    share the two cores and more threads collapse under contention (notes/opd-learning-facts)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
