"""Experiment trackers (spec.trackers): MLflow, TensorBoard and Weights & Biases receive each train
step's metrics and every held-out evaluation from trainer rank 0 (docs/monitoring.md#experiment-trackers).

They read the driver's history lines (runtime/driver/history.py): a line's scalars go under
`train/` at its step, each evaluation it carries under `eval/<data_source>/` and `eval/score` at
the evaluation's own step (W&B, whose steps only increase, logs it at the line's step with
`eval/step` as its x-axis). Each tracker's package is imported only when the spec names it.

Trackers never hold the training loop: lines are queued and sent by one worker thread. A
tracker that fails (a server gone, bad credentials) logs a warning, once until it works again;
the metrics it missed are dropped and the job goes on. A tracker that cannot even start is left
out with a warning.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kubedistill.api.spec import DistillationJobSpec, MlflowSpec, TensorBoardSpec, TrackersSpec, WandbSpec

log = logging.getLogger("kubedistill.trackers")

Metrics = dict[str, float]
CLOSE_SECONDS = 60.0
"""How long the end of the run waits for the trackers to send what is queued."""

TRAIN_KEYS = {
    "lossTotal": "loss_total",
    "lossDistill": "loss_distill",
    "lossPg": "loss_pg",
    "gradNorm": "grad_norm",
    "lr": "learning_rate",
    "rewardMean": "reward_mean",
    "klStudentTeacher": "kl_student_teacher",
    "samplesPerSecond": "samples_per_second",
    "stalenessMean": "staleness_mean",
    "stalenessMax": "staleness_max",
    "trainerIdleRatio": "trainer_idle_ratio",
    "weightVersion": "weight_version",
    "waitSeconds": "wait_seconds",
    "trainSeconds": "train_seconds",
    "syncSeconds": "sync_seconds",
    "syncBytes": "sync_bytes",
    "syncDensity": "sync_density",
    "turnsMean": "turns_mean",
    "lossTokenShare": "loss_token_share",
    "envErrors": "env_errors",
}
"""The history line's scalars a tracker receives, and their names there (under train/)."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def train_metrics(line: Mapping[str, Any]) -> Metrics:
    """A history line's train scalars (and step phases) as tracker metrics."""
    out: Metrics = {}
    for key, name in TRAIN_KEYS.items():
        value = _number(line.get(key))
        if value is not None:
            out[f"train/{name}"] = value
    for phase, seconds in (line.get("phases") or {}).items():
        value = _number(seconds)
        if value is not None:
            out[f"train/phase_seconds/{phase}"] = value
    return out


def eval_metrics(evaluation: Mapping[str, Any]) -> Metrics:
    """One evaluation (EvalResult.to_json) as tracker metrics."""
    out: Metrics = {}
    score = _number(evaluation.get("score"))
    if score is not None:
        out["eval/score"] = score
    for source, s in (evaluation.get("sources") or {}).items():
        for key, name in (("score", "score"), ("responseLength", "response_length"), ("reverseKL", "reverse_kl")):
            value = _number(s.get(key))
            if value is not None:
                out[f"eval/{source}/{name}"] = value
    return out


class Sink(Protocol):
    """One tracker."""

    name: str

    def log_line(self, line: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...


class StepSink:
    """A tracker that takes metrics at any step, in any order (MLflow, TensorBoard)."""

    name = "tracker"

    def log(self, step: int, metrics: Metrics) -> None:
        raise NotImplementedError

    def log_line(self, line: Mapping[str, Any]) -> None:
        step = int(line["step"])
        self.log(step, train_metrics(line))
        for evaluation in line.get("evaluations") or []:
            self.log(int(evaluation["step"]), eval_metrics(evaluation))

    def close(self) -> None:
        pass


class TensorBoardSink(StepSink):
    name = "tensorboard"

    def __init__(self, spec: TensorBoardSpec):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(spec.log_dir))

    def log(self, step: int, metrics: Metrics) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MlflowSink(StepSink):
    name = "mlflow"

    def __init__(self, spec: MlflowSpec, job: str, params: Mapping[str, Any]):
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=spec.tracking_uri)
        name = spec.experiment or job
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment, run_name=spec.run_name or job).info.run_id
        for key, value in params.items():
            self.client.log_param(self.run_id, key, value)

    def log(self, step: int, metrics: Metrics) -> None:
        from mlflow.entities import Metric

        if not metrics:
            return
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbSink:
    name = "wandb"

    def __init__(self, spec: WandbSpec, job: str, params: Mapping[str, Any]):
        import wandb

        self.run = wandb.init(
            project=spec.project,
            entity=spec.entity,
            name=spec.run_name or job,
            mode=spec.mode.value,
            dir=str(spec.dir) if spec.dir is not None else None,
            config=dict(params),
        )
        # A held-out evaluation arrives after later train steps: plot it against its own step.
        self.run.define_metric("eval/step")
        self.run.define_metric("eval/*", step_metric="eval/step")

    def log_line(self, line: Mapping[str, Any]) -> None:
        step = int(line["step"])
        self.run.log(train_metrics(line), step=step)
        for evaluation in line.get("evaluations") or []:
            self.run.log({**eval_metrics(evaluation), "eval/step": int(evaluation["step"])}, step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() can return before W&B's service process has written the run's log out (an
        # offline run file was seen empty right after it); teardown waits for the service to end.
        import wandb

        wandb.teardown()


def run_params(spec: DistillationJobSpec) -> dict[str, Any]:
    """The job's settings a tracker records with the run (MLflow params, W&B config)."""
    d = spec.algorithm.distillation
    return {
        "mode": spec.mode.value,
        "student": spec.student.model,
        "teachers": ",".join(t.name for t in spec.teachers),
        "loss_mode": d.loss_mode.value,
        "use_task_rewards": d.use_task_rewards,
        "lr": spec.trainer.optim.lr,
        "total_steps": spec.trainer.total_steps,
        "mini_batch_size": spec.trainer.mini_batch_size,
        "samples_per_prompt": spec.rollout.sampling.samples_per_prompt,
        "temperature": spec.rollout.sampling.temperature,
    }


def open_sinks(spec: TrackersSpec, job: str, params: Mapping[str, Any]) -> list[Sink]:
    """The trackers the spec names that could start (one that cannot is left out, with a warning)."""
    mlflow, tensorboard, wandb = spec.mlflow, spec.tensorboard, spec.wandb
    makers: list[tuple[str, Any]] = []
    if mlflow is not None:
        makers.append(("mlflow", lambda: MlflowSink(mlflow, job, params)))
    if tensorboard is not None:
        makers.append(("tensorboard", lambda: TensorBoardSink(tensorboard)))
    if wandb is not None:
        makers.append(("wandb", lambda: WandbSink(wandb, job, params)))
    sinks: list[Sink] = []
    for name, make in makers:
        try:
            sinks.append(make())
        except ImportError as e:
            log.warning(
                "tracker %s left out: its package is not installed (pip install kubedistill[%s]): %s", name, name, e
            )
        except Exception as e:
            log.warning("tracker %s left out: it could not start: %r", name, e)
    return sinks


class Trackers:
    """Sends history lines to the sinks from one worker thread (the driver never waits on them)."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks
        self.failing: set[str] = set()
        """Trackers whose last call failed (warned once until one succeeds)."""
        self._queue: queue.Queue[Mapping[str, Any] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="trackers", daemon=True)
        self._worker.start()

    @classmethod
    def open(cls, spec: TrackersSpec | None, job: str, params: Mapping[str, Any]) -> Trackers | None:
        if spec is None:
            return None
        sinks = open_sinks(spec, job, params)
        return cls(sinks) if sinks else None

    def log_line(self, line: Mapping[str, Any]) -> None:
        """Queue one history line (a copy: the driver goes on with its own)."""
        self._queue.put(dict(line))

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Send what is queued (waiting at most `timeout`), then end every tracker's run."""
        self._queue.put(None)
        self._worker.join(timeout)
        if self._worker.is_alive():
            log.warning("trackers still sending after %.0f s: the rest is dropped", timeout)
            return
        for sink in self.sinks:
            self._call(sink, "close", sink.close)

    def _run(self) -> None:
        while True:
            line = self._queue.get()
            if line is None:
                return
            for sink in self.sinks:
                self._call(sink, f"step {line.get('step')}", lambda s=sink, ln=line: s.log_line(ln))

    def _call(self, sink: Sink, what: str, fn: Any) -> None:
        try:
            fn()
        except Exception as e:
            if sink.name not in self.failing:
                log.warning(
                    "tracker %s failed (%s): %r; the job goes on without it until it answers", sink.name, what, e
                )
            self.failing.add(sink.name)
            return
        if sink.name in self.failing:
            log.info("tracker %s works again", sink.name)
            self.failing.discard(sink.name)
