"""`kubedistill role trainer`: one trainer rank.

Rank 0 serves GET /status, /health, /metrics on --host/--port, resumes from the newest
checkpoint (spec.checkpoint.resume: auto), forms the weight-sync group with the rollout servers
and runs the driver (runtime/driver/loop.py) until totalSteps; then the final checkpoint, the
student exported to `<checkpoint.path>/student-hf`, exit 0. Ranks >= 1 join torch.distributed
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and follow rank 0's calls.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kubedistill import gc_settings
from kubedistill.api.progress import TERMINATION_LOG, termination_message

if TYPE_CHECKING:
    from kubedistill.api.progress import TrainerProgress
    from kubedistill.api.roleconfig import JobConfig
    from kubedistill.api.spec import DistillationJobSpec
    from kubedistill.runtime.driver.loop import Driver
    from kubedistill.runtime.environments import Environments
    from kubedistill.runtime.metrics import RoleMetrics
    from kubedistill.runtime.trackers import Trackers
    from kubedistill.runtime.trainer import Trainer

log = logging.getLogger("kubedistill.trainer")


def _init_distributed(spec: DistillationJobSpec, rank: int, world: int) -> None:
    import datetime

    import torch.distributed as dist

    from kubedistill.runtime.trainer.distributed import process_group_backend

    if world <= 1 or dist.is_initialized():
        return
    dist.init_process_group(
        process_group_backend(spec.device),
        init_method="env://",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=max(600, spec.weight_sync.timeout_seconds)),
    )


def run(args: argparse.Namespace) -> int:
    from kubedistill.api.roleconfig import trainer_rank
    from kubedistill.runtime.entrypoints.roles import _load

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:
        config, identity, port = _load(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kubedistill role trainer: {e}", file=sys.stderr)
        return 2
    spec = config.spec
    rank = trainer_rank(identity, os.environ)
    world = int(os.environ.get("WORLD_SIZE", "1"))

    import torch

    from kubedistill.api.spec import Device

    torch.set_num_threads(
        spec.trainer.overrides.cpu_threads or 1 if spec.device is Device.cpu else torch.get_num_threads()
    )
    _init_distributed(spec, rank, world)

    from kubedistill.runtime.metrics import RoleMetrics
    from kubedistill.runtime.trainer import Trainer
    from kubedistill.runtime.trainer.distributed import leave_process_group

    metrics = RoleMetrics(config.job, "trainer", rank)
    if rank != 0:
        trainer = Trainer(spec, metrics=metrics)
        trainer.follow()
        leave_process_group()
        return 0
    from kubedistill.api.roleconfig import CONFIG_PATH

    code = asyncio.run(_run_driver(config, args.host, port, metrics, Path(args.config or CONFIG_PATH)))
    if code == 0:  # after a failure the other ranks may be gone: no collective, the exit code says it
        leave_process_group()
    return code


def rollout_source(config_path: Path) -> Callable[[], list[str]]:
    """The rollout servers the job wants now: endpoints.rollout of the job's config, re-read each
    call. The operator rewrites that ConfigMap when the job scales (the kubelet refreshes the
    mounted file), `kubedistill run` its config.json; both replace it whole."""
    from kubedistill.api.roleconfig import JobConfig

    def read() -> list[str]:
        return list(JobConfig.load(config_path).endpoints.rollout)

    return read


async def _run_driver(config: JobConfig, host: str, port: int, metrics: RoleMetrics, config_path: Path) -> int:
    """Rank 0: the status server, the trainer, resume, the weight-sync group, then the driver."""
    from kubedistill.api.progress import TrainerProgress
    from kubedistill.runtime.driver.history import HistoryWriter
    from kubedistill.runtime.entrypoints.status_server import StatusServer
    from kubedistill.runtime.trackers import Trackers, run_params

    spec = config.spec
    status = TrainerProgress(total_steps=spec.trainer.total_steps)
    server = StatusServer(status, metrics, host, port)
    await server.start()
    trainer = None
    trackers: Trackers | None = None
    try:
        trainer, driver = await asyncio.to_thread(_build, config, metrics, status, rollout_source(config_path))
        resumed = await asyncio.to_thread(trainer.resume)
        if resumed is not None:
            driver.restore(resumed.step, resumed.weight_version, resumed.driver_state)
            status.last_checkpoint = str(resumed.path)
        log.info("waiting for %d rollout server(s) to join the weight-sync group", len(config.endpoints.rollout))
        from kubedistill.runtime.weight_sync.sender import WeightSender

        driver.sender = await asyncio.to_thread(WeightSender, spec, config.endpoints, metrics)
        if resumed is not None:
            # The rollout servers may hold other weights (fresh start, or a newer un-checkpointed
            # version): give them the checkpoint's, under its version number.
            await driver.sync_weights(resumed.weight_version)
        trackers = Trackers.open(spec.trackers, config.job, run_params(spec))
        driver.history = HistoryWriter.from_env(sinks=[trackers.log_line] if trackers is not None else None)
        _drain_on_sigterm(driver, trackers, status)
        settle_gc()
        await driver.run()
        # In order: the weight-sync group (the rollout servers are in it), then the trainer ranks
        # (Trainer.close releases the followers and ends on their barrier).
        if driver.sender is not None:
            driver.sender.close()
        await asyncio.to_thread(trainer.close)
        return 0
    except Exception as e:
        status.set_phase("failed", f"{type(e).__name__}: {e}")
        traceback.print_exc()
        return 1
    finally:
        if trackers is not None:
            await asyncio.to_thread(trackers.close)
        await server.stop()
        write_termination_message(status)


GC_THRESHOLDS = (10_000, 20, 20)
"""Rank 0's collector thresholds for the run (Python's are 700, 10, 10): young collections every
10,000 net allocations rather than 700, and a full one at most every 20 of the middle ones."""


def settle_gc() -> None:
    """Rank 0's garbage collector for the run (docs/design.md#at-scale). Everything made so far
    (torch, transformers, the model, the driver: some 240,000 tracked objects) moves to the
    permanent generation, so a full collection walks only what the run makes; and collections
    run less often, since every /score answer brings thousands of new top-k row lists. In the
    fleet simulator this halved the driver's CPU per token at top-0 and top-64."""
    gc_settings.settle_gc(GC_THRESHOLDS)


TERM_DRAIN_SECONDS = 20.0
"""On SIGTERM, how long the trackers may take to send what they hold: inside Kubernetes' default
grace period of 30 s, before its SIGKILL."""


def _drain_on_sigterm(driver: Driver, trackers: Trackers | None, status: TrainerProgress) -> None:
    """A SIGTERM (pod deleted, preempted, evicted, suspended; `kubedistill run` stopped) ends the
    rank at once, as a signal would (exit 143), but first the trackers send the lines still queued
    for their worker thread and the termination message says where the run stood: otherwise the
    steps since the trackers' last send are lost from MLflow, TensorBoard and W&B. Meanwhile the
    trainer starts no more work (Driver.freeze) and the history closes: the run ends where its last
    recorded step and checkpoint say, as it would have at once without the drain."""
    import signal

    from kubedistill.runtime.entrypoints.roles import finish_process

    loop = asyncio.get_running_loop()
    before = signal.getsignal(signal.SIGTERM)

    async def drain_and_exit() -> None:
        log.warning("terminated: sending what the trackers hold (at most %.0f s), then exiting", TERM_DRAIN_SECONDS)
        if trackers is not None:
            await asyncio.to_thread(trackers.close, TERM_DRAIN_SECONDS)
        write_termination_message(status)
        finish_process(128 + signal.SIGTERM)

    def terminated() -> None:
        driver.history.closed = True
        driver.freeze()
        loop.remove_signal_handler(signal.SIGTERM)  # a second SIGTERM ends it as before
        signal.signal(signal.SIGTERM, before)
        loop.create_task(drain_and_exit())

    loop.add_signal_handler(signal.SIGTERM, terminated)


def write_termination_message(status: TrainerProgress, path: Path = Path(TERMINATION_LOG)) -> None:
    """On Kubernetes, the final /status as the container's termination message (the kubelet made
    the file); elsewhere there is no such file, and nothing is written."""
    if path.is_file():
        try:
            path.write_text(termination_message(status))
        except OSError as e:
            log.warning("could not write the termination message to %s: %s", path, e)


def _build(
    config: JobConfig, metrics: RoleMetrics, status: TrainerProgress, source: Callable[[], list[str]]
) -> tuple[Trainer, Driver]:
    from transformers import AutoTokenizer

    from kubedistill.runtime.driver.loop import Driver
    from kubedistill.runtime.models.loading import check_job_vocabulary
    from kubedistill.runtime.trainer import Trainer

    spec = config.spec
    # Teacher log-probs are compared token id by token id: refuse other tokenizers before any
    # model loads (one line in status.message: "ValueError: student and teachers must share ...").
    check_job_vocabulary(spec)
    trainer = Trainer(spec, metrics=metrics)
    tok_path = spec.student.tokenizer or spec.student.model
    tokenizer = AutoTokenizer.from_pretrained(
        str(tok_path), local_files_only=True, trust_remote_code=spec.student.trust_remote_code
    )
    driver = Driver(
        spec,
        trainer=trainer,
        sender=None,
        rollout_urls=config.endpoints.rollout,
        teacher_urls=config.endpoints.teachers,
        tokenizer=tokenizer,
        metrics=metrics,
        status=status,
        rollout_source=source,
        environments=environments(config),
    )
    return trainer, driver


def environments(config: JobConfig) -> Environments | None:
    """The job's environments, for the driver's traces (None: it has none): one pool of OpenEnv
    sessions per environment, over its replicas' URLs."""
    spec = config.spec
    if not spec.environments:
        return None
    from kubedistill.runtime.environments import EnvironmentConfig, Environments

    return Environments(
        [
            EnvironmentConfig(
                name=e.name,
                urls=config.endpoints.environments[e.name],
                action_key=e.action_key,
                observation_key=e.observation_key,
                timeout_seconds=e.timeout_seconds,
            )
            for e in spec.environments
        ]
    )
