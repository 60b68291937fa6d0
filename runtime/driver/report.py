"""What a train step reports once it is done: GET /status (TrainerProgress), the trainer's
Prometheus gauges, and the step's history line (runtime/driver/history.py), closed with the
step's time budget (runtime/driver/phases.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kubedistill.api.progress import TrainerProgress
from kubedistill.runtime.driver.history import HistoryLine, HistoryWriter
from kubedistill.runtime.driver.phases import STEP_PHASES
from kubedistill.runtime.driver.samples import Sample, SampleGroup
from kubedistill.runtime.metrics import RoleMetrics
from kubedistill.runtime.weight_sync.times import SyncTimes


class StepStatsLike(Protocol):
    """What the driver reads of one trainer step's stats (runtime/trainer's StepStats)."""

    @property
    def loss_total(self) -> float: ...
    @property
    def loss_distill(self) -> float: ...
    @property
    def loss_pg(self) -> float: ...
    @property
    def grad_norm(self) -> float: ...
    @property
    def lr(self) -> float: ...
    @property
    def kl(self) -> float | None: ...
    @property
    def seconds(self) -> float: ...
    @property
    def compute_seconds(self) -> float:
        """Of the step, the optimiser's compute: forward, loss, backward, clipping, AdamW."""
        ...

    @property
    def off_policy(self) -> Mapping[str, float]: ...


class SyncOutcomeLike(Protocol):
    """What a sync reports (runtime/weight_sync's TransferStats)."""

    @property
    def times(self) -> SyncTimes: ...
    @property
    def bytes(self) -> int: ...
    @property
    def plan(self) -> str: ...
    @property
    def density(self) -> float: ...
    @property
    def served(self) -> Mapping[str, int]:
        """The version each server serves after the sync, where the sender knows it."""
        ...


@dataclass(frozen=True)
class TrainedStep:
    """One step as the driver ran it: what was trained, under which versions, and the sync after."""

    step: int
    trainer_version: int
    """The weight version the step's batch was trained on."""
    version: int
    """The weight version after the step (and its sync, if any)."""
    groups: Sequence[SampleGroup]
    samples: Sequence[Sample]
    staleness: Sequence[int]
    stats: Sequence[StepStatsLike]
    waited: float
    sync: SyncOutcomeLike | None
    """The sync after the step (None: none)."""
    served: list[int | None] | None
    """Each rollout server's version after the sync (None: no sync)."""
    sync_seconds: float


@dataclass
class StepReporter:
    """Keeps the run's totals and writes each step's status, metrics and history line."""

    status: TrainerProgress
    metrics: RoleMetrics | None
    history: HistoryWriter
    run_id: str
    """Names the driver process in every history line: a restarted trainer appends to the same
    file, and its steps may follow on from the checkpoint with a clock no earlier than the last."""
    started: float = 0.0
    """The driver's clock when training started (the history's `time` counts from it)."""
    consumed: int = 0
    wait_seconds: float = 0.0

    def report(
        self, s: TrainedStep, now: float, counters: Mapping[str, int], requests_by_server: Mapping[str, int]
    ) -> HistoryLine:
        """Update /status and the gauges; return the step's history line (without its phases)."""
        self.consumed += len(s.samples)
        self.wait_seconds += s.waited
        elapsed = max(now - self.started, 1e-9)
        stats, staleness = s.stats, s.staleness
        rewards = [sample.reward for sample in s.samples if sample.reward is not None]
        st = self.status
        st.step = s.step
        st.samples_per_second = self.consumed / elapsed
        st.reward_mean = sum(rewards) / len(rewards) if rewards else None
        kls = [mb.kl for mb in stats if mb.kl is not None]
        st.kl_student_teacher = sum(kls) / len(kls) if kls else None
        st.staleness_mean = sum(staleness) / len(staleness) if staleness else 0.0
        st.trainer_idle_ratio = self.wait_seconds / elapsed
        if self.metrics is not None:
            self.metrics["step"].set(s.step)
            self.metrics["trainer_idle_ratio"].set(st.trainer_idle_ratio)
            if st.reward_mean is not None:
                self.metrics["reward_mean"].set(st.reward_mean)
            self.metrics["weight_version"].set(s.version)
        last = stats[-1]
        return {
            **st.to_json(),
            "runId": self.run_id,
            "trainerVersion": s.trainer_version,
            "synced": s.sync is not None,
            "rolloutVersions": s.served,
            "lossTotal": sum(mb.loss_total for mb in stats) / len(stats),
            "lossDistill": sum(mb.loss_distill for mb in stats) / len(stats),
            "lossPg": sum(mb.loss_pg for mb in stats) / len(stats),
            "gradNorm": last.grad_norm,
            "lr": last.lr,
            "stalenessMax": max(staleness) if staleness else 0,
            "groups": [g.group_id for g in s.groups],
            "resumedSamples": sum(sample.resumed for sample in s.samples),
            # [first, last] weight version of the tokens of each trained sample that was resumed
            # across a sync (partialRollout: resume), and the run's samples_total counters.
            "resumedVersionRanges": [
                [sample.min_version, sample.max_version] for sample in s.samples if sample.resumed
            ],
            "samplesTotal": dict(counters),
            "waitSeconds": round(s.waited, 4),
            "trainSeconds": round(sum(mb.seconds for mb in stats), 4),
            "syncSeconds": round(s.sync_seconds, 4),
            # What the sync sent (weightSync.delta): its plan, bytes and changed fraction.
            **(
                {"syncPlan": s.sync.plan, "syncBytes": s.sync.bytes, "syncDensity": round(s.sync.density, 6)}
                if s.sync is not None
                else {}
            ),
            "droppedStale": counters["dropped_stale"],
            "lagHistogram": {str(lag): staleness.count(lag) for lag in sorted(set(staleness))},
            "offPolicy": _mean_per_key([mb.off_policy for mb in stats]),
            "rolloutRequests": dict(requests_by_server),
            **_trace_stats(s.samples),
        }

    def end_step(self, line: HistoryLine, phases: Mapping[str, float], at: float) -> None:
        """Write the step's line, stamped with its end `at` and its phases, and observe the phases
        in kubedistill_step_seconds."""
        if self.metrics is not None:
            for phase in STEP_PHASES:
                self.metrics["step_seconds"].labels(phase=phase).observe(phases[phase])
        line["time"] = round(at - self.started, 3)
        line["phases"] = {phase: round(seconds, 4) for phase, seconds in phases.items()}
        self.history.write(line)


def _trace_stats(samples: Sequence[Sample]) -> dict[str, float | int]:
    """A step's multi-turn traces (none: nothing): student turns per trace, the share of response
    tokens that carry loss (the student's, not the environment's), traces an environment ended."""
    traces = [x for x in samples if x.turns]
    if not traces:
        return {}
    tokens = sum(len(x.response_ids) for x in traces)
    observed = sum(end - start for x in traces for start, end in x.observation_spans)
    return {
        "turnsMean": sum(x.turns for x in traces) / len(traces),
        "lossTokenShare": round((tokens - observed) / tokens, 6) if tokens else 1.0,
        "envErrors": sum(1 for x in traces if x.env_error is not None),
    }


def _mean_per_key(dicts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each key's mean over the dicts holding it (one per mini-batch of a step)."""
    keys = {k for d in dicts for k in d}
    return {k: sum(d[k] for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in sorted(keys)}
