"""runtime/environments: the driver's OpenEnv client, against a real OpenEnv server (an
environment the test writes on openenv's own API, served by openenv's create_app under uvicorn
from the venv examples/environments/install-openenv.sh makes) and, for the answers no OpenEnv
server gives (malformed JSON, a connection cut mid-episode), small aiohttp WebSocket servers.

The servers come from tests/openenv_server.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from aiohttp import web

from kubedistill.runtime.environments import (
    EnvironmentClient,
    EnvironmentConfig,
    EnvironmentPool,
    EpisodeFailed,
    StepResult,
)
from kubedistill.runtime.environments.client import http_url, parse_observation, render_observation, ws_url
from openenv_server import OpenEnvServer
from ports import free_port

# An environment written on openenv's API that misbehaves on request; its per-session turn count and
# reset tag show whether state lives in the session.
SCRIPTED = textwrap.dedent("""
    import time

    from openenv.core.env_server import Action, Environment, Observation, State, create_app


    class ScriptAction(Action):
        message: str


    class ScriptObservation(Observation):
        text: str = ""
        turn: int = 0


    class ScriptedEnvironment(Environment[ScriptAction, ScriptObservation, State]):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state = State(step_count=0)
            self.tag = ""

        def reset(self, seed=None, episode_id=None, tag="", **kwargs):
            self._state = State(episode_id=episode_id, step_count=0)
            self.tag = tag
            return ScriptObservation(text=f"ready {tag}", metadata={"hidden": True})

        def step(self, action, timeout_s=None, **kwargs):
            self._state.step_count += 1
            if action.message.startswith("sleep "):
                time.sleep(float(action.message.split()[1]))
            if action.message == "raise":
                raise RuntimeError("the environment broke")
            done = action.message == "done"
            return ScriptObservation(
                text=f"{self.tag}: {action.message}", turn=self._state.step_count, done=done,
                reward=1.5 if done else None, metadata={"hidden": True},
            )

        @property
        def state(self):
            return self._state


    app = create_app(ScriptedEnvironment, ScriptAction, ScriptObservation, max_concurrent_envs=4)
""")


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The scripted environment under openenv-core 0.3.0 (4 sessions at most)."""
    home = tmp_path_factory.mktemp("scripted")
    (home / "scripted.py").write_text(SCRIPTED)
    server = OpenEnvServer("openenv-core==0.3.0", home, "scripted:app", home / "server.log")
    try:
        yield server.url()
    finally:
        server.stop()


# ---- pure parts ----


def test_urls_take_every_form() -> None:
    assert ws_url("http://env-0.svc:8000") == "ws://env-0.svc:8000/ws"
    assert ws_url("https://h/prefix/") == "wss://h/prefix/ws"
    assert ws_url("ws://h:1/ws") == "ws://h:1/ws"
    assert ws_url("h:1") == "ws://h:1/ws"
    assert http_url("ws://h:1/ws") == "http://h:1"
    assert http_url("wss://h/p/ws") == "https://h/p"
    assert http_url("http://h:1/") == "http://h:1"


def test_observation_text_is_the_key_or_the_json_less_done_reward_metadata() -> None:
    obs = {"result": "408", "n": 3, "done": False, "reward": None, "metadata": {"x": 1}}
    assert render_observation(obs, "result") == "408"
    assert render_observation(obs, "n") == "3"
    assert json.loads(render_observation(obs, None)) == {"result": "408", "n": 3}
    with pytest.raises(ValueError, match="no field 'missing'"):
        render_observation(obs, "missing")


def test_an_answer_parses_into_a_step_result() -> None:
    doc = {"type": "observation", "data": {"observation": {"t": "x"}, "reward": True, "done": True}}
    assert parse_observation(json.dumps(doc), "t") == StepResult("x", 1.0, True)
    doc["data"] = {"observation": {"t": "x"}}  # reward and done may be left out
    assert parse_observation(json.dumps(doc).encode(), "t") == StepResult("x", None, False)


@pytest.mark.parametrize(
    "raw",
    [
        "not json",
        "[1, 2]",
        '{"type": "observation"}',
        '{"type": "observation", "data": {"observation": "text"}}',
        '{"type": "observation", "data": {"observation": {}, "done": "yes"}}',
        '{"type": "observation", "data": {"observation": {}, "reward": "high"}}',
        '{"type": "observation", "data": {"observation": {}, "reward": NaN}}',
        '{"type": "state", "data": {}}',
    ],
)
def test_malformed_answers_raise_value_error(raw: str) -> None:
    with pytest.raises(ValueError):
        parse_observation(raw, None)


# ---- against a real OpenEnv server ----


async def test_episodes_keep_their_state_each_in_its_own_session(scripted: str) -> None:
    async def episode(tag: str) -> list[StepResult]:
        async with EnvironmentClient(scripted, observation_key="text") as client:
            results = [await client.open(tag=tag)]
            for word in ("a", "b"):
                results.append(await client.step(word))
            results.append(await client.step("done"))
            await client.close()
            return results

    one, two = await asyncio.gather(episode("one"), episode("two"))
    assert one == [
        StepResult("ready one", None, False),
        StepResult("one: a", None, False),
        StepResult("one: b", None, False),
        StepResult("one: done", 1.5, True),
    ]
    assert [r.observation_text for r in two] == ["ready two", "two: a", "two: b", "two: done"]


async def test_the_default_observation_text_leaves_metadata_out(scripted: str) -> None:
    async with EnvironmentClient(scripted) as client:
        first = await client.open()
        assert json.loads(first.observation_text) == {"text": "ready ", "turn": 0}
        assert json.loads((await client.step("x")).observation_text) == {"text": ": x", "turn": 1}


def test_openenv_http_step_is_stateless(scripted: str) -> None:
    """Why the client holds a WebSocket: HTTP /step builds a fresh environment per request, so
    the episode /reset began is not the one /step sees (the tag is gone, the turn is 1 again)."""

    def post(path: str, body: dict[str, object]) -> dict[str, object]:
        req = urllib.request.Request(scripted + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    assert post("/reset", {"tag": "kept?"})["observation"] == {"text": "ready kept?", "turn": 0}
    for _ in range(2):
        assert post("/step", {"action": {"message": "hi"}})["observation"] == {"text": ": hi", "turn": 1}


async def test_a_slow_step_times_out_and_the_server_serves_the_next_episode(scripted: str) -> None:
    async with EnvironmentClient(scripted, observation_key="text") as client:
        await client.open()
        client.timeout = 1.0
        with pytest.raises(EpisodeFailed) as failed:
            await client.step("sleep 3")
        assert failed.value.reason == "timeout" and not client.is_open
        client.timeout = 30.0
        assert (await client.open(tag="next")).observation_text == "ready next"
        await client.close()
    # The abandoned session keeps its slot until its step returns (the server reads the closed
    # connection only then): wait for it, so the next test finds the server empty.
    await asyncio.sleep(3)


async def test_an_environment_that_raises_is_error_and_the_session_is_closed(scripted: str) -> None:
    async with EnvironmentClient(scripted, observation_key="text") as client:
        await client.open()
        with pytest.raises(EpisodeFailed) as failed:
            await client.step("raise")
        assert failed.value.reason == "error"
        assert "EXECUTION_ERROR" in str(failed.value) and "the environment broke" in str(failed.value)
        assert not client.is_open


async def test_an_action_key_the_environment_does_not_know_is_rejected(scripted: str) -> None:
    async with EnvironmentClient(scripted, action_key="text") as client:
        await client.open()
        with pytest.raises(EpisodeFailed) as failed:
            await client.step("x")
        assert failed.value.reason == "rejected" and "VALIDATION_ERROR" in str(failed.value)


async def test_a_full_server_is_capacity_and_a_pool_can_wait_for_a_session(scripted: str) -> None:
    config = EnvironmentConfig(name="s", urls=[scripted], observation_key="text")
    pool = EnvironmentPool(config)
    try:
        opened = [await pool.open() for _ in range(4)]
        with pytest.raises(EpisodeFailed) as failed:
            await pool.open()
        assert failed.value.reason == "capacity" and pool.outstanding == {scripted: 4}
        for client, _ in opened:
            await client.close()
        assert pool.outstanding == {scripted: 0}
    finally:
        await pool.aclose()

    waiting = EnvironmentPool(config, max_sessions_per_replica=4)
    try:
        opened = [await waiting.open() for _ in range(4)]
        fifth = asyncio.create_task(waiting.open(tag="fifth"))
        await asyncio.sleep(0.5)
        assert not fifth.done()
        await opened[0][0].close()
        client, first = await asyncio.wait_for(fifth, 30)
        assert first.observation_text == "ready fifth"
        for c in [client] + [c for c, _ in opened[1:]]:
            await c.close()
        assert waiting.outstanding == {scripted: 0}
    finally:
        await waiting.aclose()


async def test_the_jobs_environments_wait_at_capacity_for_a_session_to_free(scripted: str) -> None:
    """More traces in flight than the server's sessions: the driver's episode waits for one (up
    to timeoutSeconds) rather than end its trace with "capacity"."""
    from kubedistill.runtime.environments import Environments

    envs = Environments([EnvironmentConfig(name="s", urls=[scripted], observation_key="text", timeout_seconds=20)])
    try:
        opened = [await envs.open("s", seed=None) for _ in range(4)]
        fifth = asyncio.create_task(envs.open("s", seed=None))
        await asyncio.sleep(0.5)
        assert not fifth.done()
        await opened[0].close()
        client = await asyncio.wait_for(fifth, 20)
        for c in [client, *opened[1:]]:
            await c.close()
    finally:
        await envs.aclose()
    short = Environments([EnvironmentConfig(name="s", urls=[scripted], observation_key="text", timeout_seconds=1)])
    try:
        held = [await short.open("s", seed=None) for _ in range(4)]
        with pytest.raises(EpisodeFailed) as failed:  # past timeoutSeconds: the trace ends, counted
            await short.open("s", seed=None)
        assert failed.value.reason == "capacity"
        for c in held:
            await c.close()
    finally:
        await short.aclose()


async def test_a_url_with_no_session_route_is_its_http_status(scripted: str) -> None:
    async with EnvironmentClient(scripted + "/elsewhere") as client:
        with pytest.raises(EpisodeFailed) as failed:
            await client.open()
        assert failed.value.reason == "http_403"  # Starlette refuses a WebSocket it has no route for
        await EnvironmentClient(scripted).health()


# ---- answers no OpenEnv server gives ----

Handler = Callable[[web.WebSocketResponse, dict[str, object]], Awaitable[bool]]


@contextlib.asynccontextmanager
async def fake_server(on_message: Handler) -> AsyncIterator[str]:
    """A WebSocket server at /ws that hands each message to `on_message` (False: stop serving
    the connection, which closes it)."""

    async def ws(request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        async for msg in sock:
            if not await on_message(sock, json.loads(msg.data)):
                break
        return sock

    app = web.Application()
    app.router.add_get("/ws", ws)
    app.router.add_get("/health", lambda _: web.json_response({"status": "healthy"}))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def answering(raw: str | bytes) -> Handler:
    async def on_message(sock: web.WebSocketResponse, message: dict[str, object]) -> bool:
        if message["type"] == "reset":
            await sock.send_str(json.dumps({"type": "observation", "data": {"observation": {"o": 0}}}))
        elif isinstance(raw, bytes):
            await sock.send_bytes(raw)
        else:
            await sock.send_str(raw)
        return True

    return on_message


@pytest.mark.parametrize(
    "raw",
    ["{not json", b"\xff\xfe", '{"type": "observation", "data": {"observation": {}, "done": 1}}'],
    ids=["text", "binary", "shape"],
)
async def test_malformed_answers_end_the_trace_as_malformed(raw: str | bytes) -> None:
    async with fake_server(answering(raw)) as url, EnvironmentClient(url) as client:
        assert (await client.open()).observation_text == '{"o": 0}'
        with pytest.raises(EpisodeFailed) as failed:
            await client.step("x")
        assert failed.value.reason == "malformed" and not client.is_open


async def test_an_oversized_frame_is_malformed(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubedistill.runtime.environments import client as module

    monkeypatch.setattr(module, "MAX_MESSAGE_BYTES", 1024)
    big = json.dumps({"type": "observation", "data": {"observation": {"o": "x" * 4096}}})
    async with fake_server(answering(big)) as url, EnvironmentClient(url) as client:
        await client.open()
        with pytest.raises(EpisodeFailed) as failed:
            await client.step("x")
        assert failed.value.reason == "malformed"


async def test_a_connection_cut_mid_episode_is_gone() -> None:
    async def close_on_step(sock: web.WebSocketResponse, message: dict[str, object]) -> bool:
        if message["type"] == "step":
            return False
        await sock.send_str(json.dumps({"type": "observation", "data": {"observation": {}}}))
        return True

    async with fake_server(close_on_step) as url, EnvironmentClient(url) as client:
        await client.open()
        with pytest.raises(EpisodeFailed) as failed:
            await client.step("x")
        assert failed.value.reason == "gone"


async def test_close_lets_the_server_close_the_connection_first() -> None:
    # openenv-core 0.3 frees the session on "close", then closes the connection; a client that has
    # closed it already makes that close raise, and the server logs a traceback per episode.
    seen: list[object] = []

    async def on_message(sock: web.WebSocketResponse, message: dict[str, object]) -> bool:
        if message["type"] == "reset":
            await sock.send_str(json.dumps({"type": "observation", "data": {"observation": {}}}))
            return True
        try:
            seen.append((await sock.receive(timeout=0.5)).type)  # the client closed first
        except TimeoutError:
            seen.append("waited")
        await sock.close()
        return False

    async with fake_server(on_message) as url, EnvironmentClient(url) as client:
        await client.open()
        await client.close()
        assert seen == ["waited"] and not client.is_open


async def test_a_call_cancelled_mid_step_ends_the_episode() -> None:
    async def silent_on_step(sock: web.WebSocketResponse, message: dict[str, object]) -> bool:
        if message["type"] == "reset":
            await sock.send_str(json.dumps({"type": "observation", "data": {"observation": {}}}))
        return True

    async with fake_server(silent_on_step) as url:
        pool = EnvironmentPool(EnvironmentConfig(name="e", urls=[url]))
        try:
            client, _ = await pool.open()
            step = asyncio.create_task(client.step("x"))
            await asyncio.sleep(0.2)
            step.cancel()
            with pytest.raises(asyncio.CancelledError):
                await step
            assert not client.is_open and pool.outstanding == {url: 0}
        finally:
            await pool.aclose()


async def test_nothing_listening_is_gone() -> None:
    async with EnvironmentClient(f"http://127.0.0.1:{free_port()}") as client:
        with pytest.raises(EpisodeFailed) as failed:
            await client.open()
        assert failed.value.reason == "gone"
        with pytest.raises(EpisodeFailed) as failed:
            await client.health()
        assert failed.value.reason == "gone"


async def test_a_pool_spreads_episodes_and_skips_a_dead_replica() -> None:
    async def ok(sock: web.WebSocketResponse, message: dict[str, object]) -> bool:
        await sock.send_str(json.dumps({"type": "observation", "data": {"observation": {}}}))
        return True

    dead = f"http://127.0.0.1:{free_port()}"
    async with fake_server(ok) as a, fake_server(ok) as b:
        pool = EnvironmentPool(EnvironmentConfig(name="e", urls=[dead, a, b]))
        try:
            opened = [await pool.open() for _ in range(4)]
            assert pool.outstanding == {dead: 0, a: 2, b: 2}
            assert [c.url for c, _ in opened] == [a, b, a, b]
            await opened[0][0].close()
            await opened[0][0].close()  # a second close changes nothing
            assert pool.outstanding == {dead: 0, a: 1, b: 2}
            for client, _ in opened[1:]:
                await client.close()
            assert pool.outstanding == {dead: 0, a: 0, b: 0}
        finally:
            await pool.aclose()


async def test_an_unreachable_pool_raises_the_last_failure() -> None:
    pool = EnvironmentPool(EnvironmentConfig(name="e", urls=[f"http://127.0.0.1:{free_port()}"]))
    try:
        with pytest.raises(EpisodeFailed) as failed:
            await pool.open()
        assert failed.value.reason == "gone"
        assert set(pool.outstanding.values()) == {0}
    finally:
        await pool.aclose()


def test_the_client_needs_no_openenv() -> None:
    """The runtime speaks the protocol itself: openenv is only in the servers' venvs."""
    code = "import kubedistill.runtime.environments, sys; print('openenv' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
