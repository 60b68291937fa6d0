"""Multi-turn traces (runtime/driver/episodes.py): turns alternate with observations in one
sample, which end on done, maxTurns or the budget; observations carry no loss; an environment
that fails ends the trace with its reason; a restart starts a new episode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kubedistill.api.spec import DistillationJobSpec
from kubedistill.runtime.driver.episodes import Episodes, ObservationRenderer, TraceRestart
from kubedistill.runtime.driver.rewards import RewardRegistry
from kubedistill.runtime.driver.samples import Sample
from kubedistill.runtime.environments.client import EpisodeFailed
from kubedistill.runtime.metrics import RoleMetrics

EOS = 2
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class CharTokenizer:
    """One id per character (ids from 10 up), <|im_end|> as the EOS id, a real Jinja template."""

    eos_token_id = EOS
    eos_token = "<|im_end|>"

    def __init__(self, template: str = CHATML):
        self.template = template

    def apply_chat_template(
        self, conversation: list[dict[str, Any]], *, add_generation_prompt: bool, tokenize: bool
    ) -> str:
        import jinja2

        return jinja2.Template(self.template).render(messages=conversation, add_generation_prompt=add_generation_prompt)

    def __call__(self, text: str, *, add_special_tokens: bool) -> dict[str, list[int]]:
        out, i = [], 0
        while i < len(text):
            if text.startswith(self.eos_token, i):
                out.append(EOS)
                i += len(self.eos_token)
            else:
                out.append(10 + ord(text[i]))
                i += 1
        return {"input_ids": out}

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool) -> str:
        return "".join(
            "" if t == EOS and skip_special_tokens else self.eos_token if t == EOS else chr(t - 10) for t in token_ids
        )


@dataclass
class Step:
    observation_text: str
    reward: float | None = None
    done: bool = False


@dataclass
class FakeEnvironment:
    """Answers each action with a scripted step; records what it saw."""

    script: list[Step | Exception]
    actions: list[str] = field(default_factory=list)
    opened: int = 0
    closed: int = 0

    async def open(self, name: str, seed: int | None) -> FakeEnvironment:
        self.opened += 1
        return self

    async def step(self, text: str) -> Step:
        self.actions.append(text)
        item = self.script[len(self.actions) - 1]
        if isinstance(item, Exception):
            raise item
        return item

    async def close(self) -> None:
        self.closed += 1

    def replicas(self) -> list[Any]:
        return []


@dataclass
class Out:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    topk_ids: Any = None


def turns_answering(*texts: str, version: int = 3):
    """A generate_turn that answers each turn with the next text and EOS (cut at the turn's limit)."""
    tok = CharTokenizer()
    it = iter(texts)

    async def generate_turn(s: Sample) -> None:
        s.continuation()
        ids = tok(next(it), add_special_tokens=False)["input_ids"] + [EOS]
        room = s.limit - len(s.response_ids)
        ids, reason = (ids, "stop") if len(ids) <= room else (ids[:room], "length")
        s.extend(Out(ids, [-0.5] * len(ids), [version] * len(ids), reason))

    return generate_turn


def spec(max_turns: int = 4, max_trace_tokens: int | None = None, max_tokens: int = 40) -> DistillationJobSpec:
    return DistillationJobSpec.model_validate(
        {
            "device": "cpu",
            "student": {"model": "/m/s"},
            "teachers": [{"name": "t", "model": "/m/t"}],
            "data": {"train": ["/d/train.jsonl"]},
            "environments": [{"name": "calc", "command": ["serve"]}],
            "rollout": {
                "sampling": {"maxTokens": max_tokens},
                "multiTurn": {
                    "maxTurns": max_turns,
                    **({"maxTraceTokens": max_trace_tokens} if max_trace_tokens else {}),
                },
            },
        }
    )


def episodes(env: FakeEnvironment, job: DistillationJobSpec, metrics: RoleMetrics | None = None) -> Episodes:
    return Episodes(job, CharTokenizer(), env, RewardRegistry.for_spec(job), metrics)


def sample(budget: int) -> Sample:
    return Sample(group_id=1, index=0, prompt_ids=[11, 12], max_tokens=budget, ground_truth="42", reward_fn=None)


async def test_turns_alternate_with_observations_until_the_environment_is_done() -> None:
    env = FakeEnvironment([Step("7", reward=0.25), Step("", reward=0.5, done=True)])
    job = spec()
    s = sample(200)
    await episodes(env, job).run(s, turns_answering("<calc>3+4</calc>", "answer 7"), seed=0)
    assert env.actions == ["<calc>3+4</calc>", "answer 7"] and env.opened == env.closed == 1
    tok = CharTokenizer()
    text = tok.decode(s.response_ids, skip_special_tokens=False)
    # The student's EOS ends its turn; the template's newline, the tool message and the assistant's
    # generation prompt follow, as a chat of those messages renders.
    assert (
        text == "<calc>3+4</calc><|im_end|>\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\nanswer 7<|im_end|>"
    )
    ((start, end),) = s.observation_spans
    assert (
        tok.decode(s.response_ids[start:end], skip_special_tokens=False)
        == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    )
    mask = s.loss_mask()
    assert mask is not None and mask.count(False) == end - start and not any(mask[start:end])
    assert s.logprobs[start:end] == [0.0] * (end - start) and set(s.versions) == {3}
    assert s.turns == 2 and s.finished and s.reward == 0.75 and s.env_error is None


async def test_max_turns_and_the_trace_budget_end_a_trace() -> None:
    env = FakeEnvironment([Step("1"), Step("2"), Step("3")])
    s = sample(10_000)
    await episodes(env, spec(max_turns=2)).run(s, turns_answering("a", "b", "c"), seed=0)
    assert s.turns == 2 and len(env.actions) == 1  # the last turn is not sent as an action

    env = FakeEnvironment([Step("x" * 30)] * 3)
    job = spec(max_turns=8, max_trace_tokens=40, max_tokens=12)
    s = sample(40)
    await episodes(env, job).run(s, turns_answering("aaaa", "bbbb", "cccc"), seed=0)
    assert len(s.response_ids) <= 40 and s.turns == 1  # the observation left no room for a turn


async def test_each_turn_is_bounded_by_max_tokens_and_the_rest_of_the_trace() -> None:
    env = FakeEnvironment([Step("ok")] * 4)
    s = sample(150)
    await episodes(env, spec(max_turns=4, max_trace_tokens=150, max_tokens=5)).run(
        s, turns_answering("abcdefgh", "ijklmnopq", "rs", "tu"), seed=0
    )
    (a, b), (c, d), *_ = s.observation_spans
    assert a == 5 and c - b == 5  # two turns cut at sampling.maxTokens
    assert len(s.response_ids) <= 150 and s.turns == 1 + len(s.observation_spans)


@pytest.mark.parametrize("reason", ["timeout", "malformed", "gone", "http_500"])
async def test_an_environment_that_fails_ends_the_trace_with_its_reason(reason: str) -> None:
    env = FakeEnvironment([Step("1"), EpisodeFailed(reason, "http://calc:8000")])
    metrics = RoleMetrics("j", "trainer", 0)
    s = sample(200)
    await episodes(env, spec(), metrics).run(s, turns_answering("a", "b", "c"), seed=0)
    assert s.env_error == reason and s.turns == 2 and s.finished and env.closed == 1
    errors = metrics.registry.get_sample_value(
        "kubedistill_env_errors_total",
        {"job": "j", "role": "trainer", "replica": "0", "environment": "calc", "reason": reason},
    )
    assert errors == 1.0


async def test_a_restart_starts_a_new_episode_and_forgets_the_old_trace() -> None:
    env = FakeEnvironment([Step("1"), Step("", done=True), Step("", done=True)])
    answer = turns_answering("a", "b", "c")
    calls = 0

    async def interrupted_once(s: Sample) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # the second turn is interrupted without partial rollouts
            raise TraceRestart(s.sample_id)
        await answer(s)

    s = sample(200)
    await episodes(env, spec()).run(s, interrupted_once, seed=0)
    assert env.opened == env.closed == 2 and s.observation_spans == [] and s.turns == 1
    assert CharTokenizer().decode(s.response_ids, skip_special_tokens=True) == "b"


async def test_a_restored_trace_starts_over() -> None:
    s = sample(200)
    s.response_ids, s.logprobs, s.versions, s.finish_reason = [20, 21], [-1.0, -1.0], [0, 0], "abort"
    s.observation_spans = [[1, 2]]
    env = FakeEnvironment([Step("", done=True)])
    await episodes(env, spec()).run(s, turns_answering("z"), seed=0)
    assert s.observation_spans == [] and CharTokenizer().decode(s.response_ids, skip_special_tokens=True) == "z"


def test_a_template_without_roles_appends_the_observation_as_it_is() -> None:
    plain = CharTokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    r = ObservationRenderer(plain, "tool", plain.eos_token)  # type: ignore[arg-type]
    assert plain.decode(r.render(" = 12", turn_ended_with_eos=True), skip_special_tokens=False) == " = 12"


async def test_the_observation_role_is_the_chat_templates_role() -> None:
    job = spec()
    doc = job.model_dump(by_alias=True, mode="json", exclude_none=True)
    doc["rollout"]["multiTurn"]["observationRole"] = "user"
    env = FakeEnvironment([Step("7"), Step("", done=True)])
    s = sample(200)
    await episodes(env, DistillationJobSpec.model_validate(doc)).run(s, turns_answering("a", "b"), seed=0)
    (start, end), *_ = s.observation_spans
    assert (
        CharTokenizer().decode(s.response_ids[start:end], skip_special_tokens=False).startswith("\n<|im_start|>user\n7")
    )


async def test_rows_go_to_the_environment_their_routing_value_matches() -> None:
    doc = spec().model_dump(by_alias=True, mode="json", exclude_none=True)
    doc["environments"] = [
        {"name": "calc", "command": ["serve"], "match": {"dataSource": ["arith"]}},
        {"name": "search", "command": ["serve"]},
    ]
    job = DistillationJobSpec.model_validate(doc)
    opened: list[str] = []

    class Environments(FakeEnvironment):
        async def open(self, name: str, seed: int | None) -> FakeEnvironment:
            opened.append(name)
            return FakeEnvironment([Step("", done=True)])

    for value in ("arith", "wiki"):
        s = sample(200)
        s.route_value = value
        await episodes(Environments([]), job).run(s, turns_answering("a"), seed=0)
    assert opened == ["calc", "search"]


async def test_the_environments_settings_reach_the_drivers_client() -> None:
    from kubedistill.api.roleconfig import Endpoints, JobConfig
    from kubedistill.runtime.entrypoints.trainer import environments

    doc = spec().model_dump(by_alias=True, mode="json", exclude_none=True)
    doc["environments"] = [
        {"name": "calc", "command": ["x"], "actionKey": "code", "observationKey": "result", "timeoutSeconds": 7}
    ]
    urls = ["http://calc-0:8000", "http://calc-1:8000"]
    config = JobConfig(
        job="j",
        spec=DistillationJobSpec.model_validate(doc),
        endpoints=Endpoints(
            trainer="t", master_addr="t", rollout=["r"], teachers={"t": ["u"]}, environments={"calc": urls}
        ),
    )
    envs = environments(config)
    assert envs is not None
    c = envs.pools["calc"].config
    assert (c.urls, c.action_key, c.observation_key, c.timeout_seconds) == (urls, "code", "result", 7)
    assert [r.base_url for r in envs.replicas()] == urls
    await envs.aclose()


def test_a_vision_language_student_is_refused_multi_turn_in_one_line() -> None:
    job = spec()
    with pytest.raises(ValueError, match=r"^spec.rollout.multiTurn: multi-turn traces are text-only"):
        Episodes.for_job(job, CharTokenizer(), FakeEnvironment([]), RewardRegistry.for_spec(job), vision=True)
    assert Episodes.for_job(job, CharTokenizer(), FakeEnvironment([]), RewardRegistry.for_spec(job)) is not None
