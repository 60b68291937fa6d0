"""Interoperability (issue 46, part 4): the driver's client (runtime/environments) against OpenEnv
environment servers no part of the runtime wrote, each a real uvicorn process in a venv of
OpenEnv's own (examples/environments/install-openenv.sh), for both published packages:

* examples/environments/calculator: the calculator tool environment, written on openenv's API.
* OpenEnv's own echo environment: the template `openenv init` writes, served unchanged.

`openenv-core` 0.3 and `openenv` 0.10 differ on the wire: 0.10 keeps the observation's metadata
inside `observation` (and repeats it beside it); the client's text leaves it out for both."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubedistill.runtime.environments import (
    EnvironmentClient,
    EnvironmentConfig,
    EnvironmentPool,
    EpisodeFailed,
    StepResult,
)
from openenv_server import OpenEnvServer, openenv_python

ROOT = Path(__file__).resolve().parent.parent
CALCULATOR = ROOT / "examples" / "environments" / "calculator"
SPECS = ["openenv-core==0.3.0", "openenv==0.10.0"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], str]]:
    """(environment, spec) -> URL, for the calculator and the echo template under both packages.
    All four start at once: each spends its first 30-40 s importing gradio on a busy machine."""
    started: dict[tuple[str, str], OpenEnvServer] = {}
    try:
        for spec in SPECS:
            home = tmp_path_factory.mktemp(spec.split("==")[0])
            # `openenv init` writes its template; without uv on PATH it skips `uv lock` (network).
            python = openenv_python(spec)
            subprocess.run(
                [str(python.parent / "openenv"), "init", "echo_env", "--output-dir", str(home)],
                check=True, capture_output=True, env={**os.environ, "PATH": "/usr/bin:/bin"},
            )  # fmt: skip
            started["echo", spec] = OpenEnvServer(spec, home / "echo_env", "server.app:app", home / "echo.log")
            started["calculator", spec] = OpenEnvServer(spec, CALCULATOR, "server:app", home / "calculator.log")
        yield {key: server.url() for key, server in started.items()}
    finally:
        for server in started.values():
            server.stop()


@pytest.mark.parametrize("spec", SPECS)
async def test_calculator_episodes_call_the_tool_then_answer(servers: dict[tuple[str, str], str], spec: str) -> None:
    config = EnvironmentConfig(name="calc", urls=[servers["calculator", spec]], observation_key="result")
    pool = EnvironmentPool(config)

    async def episode(a: int, b: int, final: str) -> list[StepResult]:
        client, first = await pool.open(answer=a * b)
        try:
            return [
                first,
                await client.step(f"I need {a}*{b}. <calc>{a}*{b}</calc>"),
                await client.step("Two checks: <calc>(1+2)*-3</calc> <calc>2**3</calc>"),
                await client.step(final),
            ]
        finally:
            await client.close()

    try:
        # Eight traces at once, each in its own session of the one server.
        traces = await asyncio.gather(*(episode(a, 37, f"The answer is {a * 37}.") for a in range(100, 108)))
        for a, trace in zip(range(100, 108), traces):
            assert trace == [
                StepResult("", None, False),
                StepResult(str(a * 37), None, False),
                StepResult("-9\nerror: unexpected '*'", None, False),
                StepResult("", 1.0, True),
            ]
        wrong = await episode(12, 34, "It is 407.")
        assert wrong[-1] == StepResult("", 0.0, True)
        assert pool.outstanding == {config.urls[0]: 0}
    finally:
        await pool.aclose()


@pytest.mark.parametrize("spec", SPECS)
async def test_openenvs_own_echo_environment_unchanged(servers: dict[tuple[str, str], str], spec: str) -> None:
    url = servers["echo", spec]
    async with EnvironmentClient(url) as client:  # the defaults: action `message`, the JSON less metadata
        first = await client.open()
        assert json.loads(first.observation_text) == {
            "echoed_message": "Echo Env environment ready!",
            "message_length": 0,
        }
        assert first.reward == 0.0 and not first.done
        turn = await client.step("héllo")
        assert json.loads(turn.observation_text) == {"echoed_message": "héllo", "message_length": 5}
        assert turn.reward == pytest.approx(0.5) and not turn.done

        # The template allows one session (max_concurrent_envs=1): a second one is refused.
        async with EnvironmentClient(url) as other:
            with pytest.raises(EpisodeFailed) as failed:
                await other.open()
            assert failed.value.reason == "capacity"
        await client.close()

    async with EnvironmentClient(url, observation_key="echoed_message") as client:
        await client.open()
        assert await client.step("again") == StepResult("again", pytest.approx(0.5), False)
