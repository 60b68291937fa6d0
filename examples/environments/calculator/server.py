"""A calculator tool environment, written on OpenEnv's own API (pip install openenv-core).

The action is the student's whole turn (`message`). A turn that calls the tool, `<calc>12*34</calc>`,
gets the result back as the observation (`result`: "408"; several calls in one turn get one line
each) and the episode goes on. A turn with no call is the final answer: the episode is done, and
when `reset` was given the expected `answer` the reward is 1.0 if the turn's last integer equals it,
else 0.0 (no `answer`: no reward, the job's reward function scores the trace).

Expressions are parsed, never eval'd: integers, + - *, unary minus and parentheses, 200 characters
at most.

Run it as an environment server (the image's command; kubedistill's `spec.environments[].command`):
    uvicorn server:app --host 0.0.0.0 --port 8000      (from this folder)
    python server.py --port 8000
and point the environment at it with `actionKey: message`, `observationKey: result`.
"""

from __future__ import annotations

import os
import re
from typing import Any
from uuid import uuid4

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
INTEGER = re.compile(r"-?\d+")
MAX_EXPRESSION = 200


class CalcAction(Action):
    message: str = Field(..., description="The student's turn")


class CalcObservation(Observation):
    result: str = Field(default="", description="One line per <calc> call: its value, or 'error: ...'")


class _Parser:
    """expr := term (('+'|'-') term)*; term := factor ('*' factor)*; factor := '-' factor | int | '(' expr ')'."""

    def __init__(self, text: str):
        self.tokens = re.findall(r"\d+|[-+*()]|\S", text)
        self.pos = 0

    def parse(self) -> int:
        value = self.expr()
        if self.pos != len(self.tokens):
            raise ValueError(f"unexpected {self.tokens[self.pos]!r}")
        return value

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ValueError("the expression ends too early")
        self.pos += 1
        return token

    def expr(self) -> int:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> int:
        value = self.factor()
        while self.peek() == "*":
            self.take()
            value *= self.factor()
        return value

    def factor(self) -> int:
        token = self.take()
        if token == "-":
            return -self.factor()
        if token == "(":
            value = self.expr()
            if self.take() != ")":
                raise ValueError("missing ')'")
            return value
        if token.isdigit():
            return int(token)
        raise ValueError(f"unexpected {token!r}")


def calculate(expression: str) -> str:
    """The value of `expression` as text, or 'error: ...' (an error is an answer, not a fault)."""
    if len(expression) > MAX_EXPRESSION:
        return f"error: longer than {MAX_EXPRESSION} characters"
    try:
        return str(_Parser(expression).parse())
    except (ValueError, RecursionError) as e:
        return f"error: {e}"


class CalculatorEnvironment(Environment[CalcAction, CalcObservation, State]):
    # Each WebSocket session gets its own instance, and instances share nothing.
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._answer: int | None = None

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, answer: int | None = None, **kwargs: Any
    ) -> CalcObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._answer = int(answer) if answer is not None else None
        return CalcObservation(result="", done=False, reward=None)

    def step(self, action: CalcAction, timeout_s: float | None = None, **kwargs: Any) -> CalcObservation:
        self._state.step_count += 1
        calls = CALL.findall(action.message)
        if calls:
            return CalcObservation(result="\n".join(calculate(c) for c in calls), done=False, reward=None)
        reward = None
        if self._answer is not None:
            numbers = INTEGER.findall(action.message)
            reward = 1.0 if numbers and int(numbers[-1]) == self._answer else 0.0
        return CalcObservation(result="", done=True, reward=reward)

    @property
    def state(self) -> State:
        return self._state


# One session per concurrent episode: size it to the traces the job keeps in flight per replica.
app = create_app(
    CalculatorEnvironment,
    CalcAction,
    CalcObservation,
    env_name="calculator",
    max_concurrent_envs=int(os.environ.get("CALC_MAX_SESSIONS", "256")),
)


if __name__ == "__main__":
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port)
