"""The product holds no code that exists only for tests or benches."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import MagicMock

import pytest

from kubedistill.api.roleconfig import Identity, Role
from kubedistill.runtime.engines.base import Engine
from kubedistill.runtime.entrypoints.roles import add_commands
from kubedistill.runtime.servers.rollout import build_rollout_app
from server_fixtures import job_config

DEBUG_ROUTES = {"/weights/checksums", "/weights/probe"}


@pytest.mark.parametrize("debug", [False, True])
def test_checksums_and_the_transport_probe_are_served_only_with_debug_endpoints(tmp_path: Path, debug: bool) -> None:
    config = job_config(
        tmp_path / "student",
        tmp_path / "teacher",
        engine="hf",
        rollout_urls=["http://127.0.0.1:1"],
        teacher_urls=["http://127.0.0.1:2"],
        weight_sync_port=3,
    )
    app = build_rollout_app(config, Identity(role=Role.rollout), MagicMock(spec=Engine), debug_endpoints=debug)
    paths = {getattr(r, "path", "") for r in app.routes}
    assert "/weights/begin" in paths
    assert (DEBUG_ROUTES <= paths) is debug and (DEBUG_ROUTES & paths == set()) is not debug


def test_debug_endpoints_are_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    def parse(*args: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_commands(parser.add_subparsers())
        return parser.parse_args(["role", "rollout", *args])

    monkeypatch.delenv("KUBEDISTILL_DEBUG_ENDPOINTS", raising=False)
    assert parse().debug_endpoints is False
    assert parse("--debug-endpoints").debug_endpoints is True
    monkeypatch.setenv("KUBEDISTILL_DEBUG_ENDPOINTS", "1")
    assert parse().debug_endpoints is True
