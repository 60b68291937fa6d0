"""spec.trackers.wandb's settings are what the W&B run is opened with (the offline run's files:
tests/test_trackers.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kubedistill.api.spec import WandbSpec
from kubedistill.runtime.trackers import WandbSink


class _Run:
    def define_metric(self, *args: Any, **kwargs: Any) -> None:
        pass


def test_the_wandb_run_takes_project_entity_name_mode_and_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    opened: list[dict[str, Any]] = []

    def init(**kwargs: Any) -> _Run:
        opened.append(kwargs)
        return _Run()

    monkeypatch.setattr(wandb, "init", init)
    WandbSink(WandbSpec(project="p", entity="team", run_name="r1", mode="offline", dir="/runs"), "job", {"lr": 1})
    WandbSink(WandbSpec(project="p"), "job", {})
    named, default = opened
    assert (named["project"], named["entity"], named["name"], named["mode"], named["dir"]) == (
        "p", "team", "r1", "offline", "/runs"
    )  # fmt: skip
    assert named["config"] == {"lr": 1}
    assert (default["entity"], default["name"], default["mode"], default["dir"]) == (None, "job", "online", None)
