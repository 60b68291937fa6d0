"""Experiment trackers (runtime/trackers.py), each read back with its own tools: TensorBoard's event
reader, the W&B offline run's transaction log, and a real MLflow tracking server started here
(installed beside the venv by scripts/install.sh). A failing tracker warns and the job goes on."""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from kubedistill.api.spec import MlflowSpec, TensorBoardSpec, TrackersSpec, WandbSpec
from kubedistill.runtime.trackers import Trackers, eval_metrics, open_sinks, train_metrics
from mlflow_server import free_port
from mlflow_server import mlflow_server as mlflow_server_at

EVALUATION = {
    "step": 0,
    "weightVersion": 0,
    "score": 0.25,
    "sources": {"arith": {"score": 0.25, "responseLength": 3.0, "reverseKL": 0.5, "teacher": "arith"}},
}


def lines() -> list[dict[str, Any]]:
    """Three history lines as the driver writes them; the evaluation of step 0 rides on line 2."""
    out: list[dict[str, Any]] = []
    for step in (1, 2, 3):
        line: dict[str, Any] = {
            "step": step,
            "lossTotal": 1.0 / step,
            "rewardMean": 0.1 * step,
            "klStudentTeacher": None,
            "synced": True,
            "phases": {"wait": 0.5, "eval": 0.0},
        }
        if step == 2:
            line["evaluations"] = [EVALUATION]
        out.append(line)
    return out


def test_a_history_line_becomes_train_and_eval_metrics() -> None:
    line = lines()[1]
    assert train_metrics(line) == {
        "train/loss_total": 0.5,
        "train/reward_mean": 0.2,
        "train/phase_seconds/wait": 0.5,
        "train/phase_seconds/eval": 0.0,
    }
    assert eval_metrics(EVALUATION) == {
        "eval/score": 0.25,
        "eval/arith/score": 0.25,
        "eval/arith/response_length": 3.0,
        "eval/arith/reverse_kl": 0.5,
    }


class Flaky:
    """A tracker that fails on the steps it is told to, and records the rest."""

    def __init__(self, name: str, failing: set[int]):
        self.name = name
        self.failing = failing
        self.got: list[int] = []
        self.closed = False

    def log_line(self, line: Mapping[str, Any]) -> None:
        if line["step"] in self.failing:
            raise ConnectionError("tracking server gone")
        self.got.append(int(line["step"]))

    def close(self) -> None:
        self.closed = True


def test_a_failing_tracker_warns_once_and_the_others_get_every_line(caplog) -> None:
    flaky, steady = Flaky("flaky", {1, 2}), Flaky("steady", set())
    trackers = Trackers([flaky, steady])  # type: ignore[list-item]
    with caplog.at_level(logging.INFO, logger="kubedistill.trackers"):
        for line in lines():
            trackers.log_line(line)
        trackers.close()
    assert steady.got == [1, 2, 3] and flaky.got == [3]
    assert flaky.closed and steady.closed
    messages = [r.getMessage() for r in caplog.records]
    assert sum("tracker flaky failed" in m for m in messages) == 1
    assert any("tracker flaky works again" in m for m in messages)


def test_a_tracker_whose_package_is_missing_is_left_out(monkeypatch, caplog) -> None:
    import builtins

    real_import = builtins.__import__

    def no_wandb(name: str, *args: Any, **kw: Any) -> Any:
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with caplog.at_level(logging.WARNING, logger="kubedistill.trackers"):
        assert open_sinks(TrackersSpec(wandb=WandbSpec(project="p", mode="offline")), "job", {}) == []
    assert "pip install kubedistill[wandb]" in caplog.text


def test_tensorboard_event_files_hold_every_step(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = Trackers.open(TrackersSpec(tensorboard=TensorBoardSpec(log_dir=str(tmp_path))), "job", {})
    assert trackers is not None
    for line in lines():
        trackers.log_line(line)
    trackers.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss_total")]
    assert loss == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert [(e.step, e.value) for e in events.Scalars("eval/arith/score")] == [(0, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("eval/arith/reverse_kl")] == [(0, 0.5)]


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a W&B transaction log (.wandb): LevelDB's log format (32 KiB blocks of
    checksum, length, type, payload) after a 7-byte header, each payload a protobuf Record."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline_run_files_hold_every_step(tmp_path) -> None:
    import json

    spec = TrackersSpec(wandb=WandbSpec(project="kubedistill-test", mode="offline", dir=str(tmp_path)))
    trackers = Trackers.open(spec, "job", {"lr": 0.001})
    assert trackers is not None
    for line in lines():
        trackers.log_line(line)
    trackers.close()
    [log_file] = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    history: list[tuple[int, dict[str, Any]]] = []
    config: dict[str, Any] = {}
    for record in wandb_records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            history.append((record.history.step.num, items))
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            assert record.run.display_name == "job"
    loss = [(step, items["train/loss_total"]) for step, items in history if "train/loss_total" in items]
    assert loss == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    evals = [(items["eval/step"], items["eval/arith/score"]) for _, items in history if "eval/step" in items]
    assert evals == [(0, 0.25)]
    assert config["lr"] == 0.001


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[str]:
    """A real MLflow tracking server (tests/mlflow_server.py) on loopback."""
    try:
        with mlflow_server_at(tmp_path_factory.mktemp("mlflow")) as uri:
            yield uri
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


def test_mlflow_run_on_a_real_server_holds_every_step(mlflow_server: str) -> None:
    from mlflow import MlflowClient

    spec = TrackersSpec(mlflow=MlflowSpec(tracking_uri=mlflow_server, experiment="kubedistill-test", run_name="r1"))
    trackers = Trackers.open(spec, "job", {"lr": 0.001, "mode": "sync"})
    assert trackers is not None
    for line in lines():
        trackers.log_line(line)
    trackers.close()
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("kubedistill-test")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.001", "mode": "sync"}
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss_total"))
    assert loss == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    score = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/arith/score")]
    assert score == [(0, 0.25)]


def test_mlflow_server_gone_warns_and_the_lines_keep_flowing(monkeypatch, caplog) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    spec = TrackersSpec(mlflow=MlflowSpec(tracking_uri=f"http://127.0.0.1:{free_port()}"))
    with caplog.at_level(logging.WARNING, logger="kubedistill.trackers"):
        assert Trackers.open(spec, "job", {}) is None  # nothing answers: left out, the job goes on
    assert "tracker mlflow left out: it could not start" in caplog.text


async def test_a_runs_steps_and_evaluations_reach_the_tracker(tmp_path) -> None:
    """The driver's real loop (tests/driver_fakes.py) with the trainer's wiring: history lines,
    evaluations included, reach TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from driver_fakes import rig
    from kubedistill.runtime.driver.history import HistoryWriter
    from test_driver_evaluation import eval_spec

    spec = eval_spec(tmp_path, {"everySteps": 2}, steps=4)
    trackers = Trackers.open(TrackersSpec(tensorboard=TensorBoardSpec(log_dir=str(tmp_path / "tb"))), "job", {})
    assert trackers is not None
    r = rig(spec, history=HistoryWriter(sinks=[trackers.log_line]))
    await r.run()
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/phase_seconds/wait")] == [1, 2, 3, 4]
    assert [(e.step, e.value) for e in events.Scalars("eval/score")] == [(0, 0.5), (2, 0.5), (4, 0.5)]


SIGTERMED_TRAINER = """
import asyncio, os, signal, sys, time
from pathlib import Path
from kubedistill.api.progress import TrainerProgress
from kubedistill.runtime.entrypoints import trainer
from kubedistill.runtime.driver.history import HistoryWriter
from kubedistill.runtime.trackers import Trackers

class Slow:
    name = "slow"
    def log_line(self, line):
        time.sleep(0.2)  # a tracker server slower than the steps: lines queue up
        with open(sys.argv[1], "a") as f:
            f.write(f"{line['step']}\\n")
    def close(self):
        with open(sys.argv[1], "a") as f:
            f.write("closed\\n")

async def main():
    trackers = Trackers([Slow()])
    history = HistoryWriter(Path(sys.argv[1] + ".history"), sinks=[trackers.log_line])

    class Driver:  # what the drain touches of the driver
        def __init__(self):
            self.history = history

        def freeze(self):
            with open(sys.argv[1] + ".frozen", "w"):
                pass

    trainer._drain_on_sigterm(Driver(), trackers, TrainerProgress(total_steps=10))
    for step in range(1, 6):
        history.write({"step": step})
    os.kill(os.getpid(), signal.SIGTERM)
    for step in range(6, 100):  # the training loop goes on until the signal ends it
        await asyncio.sleep(0.1)
        history.write({"step": step})

asyncio.run(main())
"""


def test_a_sigterm_sends_what_the_trackers_hold_then_exits_143(tmp_path: Path) -> None:
    import subprocess
    import sys

    got = tmp_path / "sent"
    argv = [sys.executable, "-c", SIGTERMED_TRAINER, str(got)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, proc.stderr
    assert got.read_text().split() == ["1", "2", "3", "4", "5", "closed"], proc.stderr
    # Steps after the signal are recorded nowhere: the history and the trackers agree.
    assert len(Path(f"{got}.history").read_text().splitlines()) == 5
    assert Path(f"{got}.frozen").is_file()  # and the trainer started no more work (no checkpoint)
    assert "terminated: sending what the trackers hold" in proc.stderr
