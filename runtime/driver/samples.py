"""Samples and sample groups: one response with the weight version of every token, and the n
responses to one prompt (a GRPO group), plus partial-rollout resume.

A generation interrupted by a weight sync comes back with `finish_reason == "abort"` and the
tokens produced so far. `Sample.continuation()` gives the next request (prompt + the tokens so far
as `prefix_token_ids`, the same whole-response token budget); `Sample.extend()` appends what that request
returns. The merged response is prefix + continuation, and each token keeps the log-prob and the
weight version of the request that sampled it, so the loss uses the right behaviour policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kubedistill.api.losses import Signal
from kubedistill.runtime.wire.rows import Rows, row_lengths

if TYPE_CHECKING:
    from kubedistill.runtime.driver.data import PromptItem
    from kubedistill.runtime.wire.batch import SampleArrays

FINISHED = ("stop", "length")
TEACHER_SIGNALS = tuple(s for s in Signal if s is not Signal.rollout_topk_ids)
"""What a teacher's /score fills in (and clear_scores forgets)."""
FINISH_REASONS = ("stop", "length", "abort")
SignalValues = list[Any] | np.ndarray
"""One signal of a sample: a value or row per response token (a teacher's full rows: [T, k])."""


class GenerationOutput(Protocol):
    """What one /generate call returns (kubedistill.runtime.wire.protocol.GenerateResponse)."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def logprobs(self) -> Sequence[float]: ...
    @property
    def versions(self) -> Sequence[int]: ...
    @property
    def finish_reason(self) -> str: ...
    @property
    def topk_ids(self) -> Rows | None: ...


class ScoreOutput(Protocol):
    """What one /score call returns (kubedistill.runtime.wire.protocol.ScoreResponse)."""

    @property
    def logprobs(self) -> Sequence[float]: ...
    @property
    def topk_ids(self) -> Rows: ...
    @property
    def topk_logprobs(self) -> Rows: ...
    @property
    def gather_logprobs(self) -> Rows | None: ...


def call_seed(base: int, prompt: int, index: int, call: int = 0) -> int:
    """The seed of one /generate call, distinct and reproducible: from `base` (the spec's seed in
    training, the step in a held-out evaluation), the prompt's uid, the sample's place among the
    prompt's samples (they must differ) and the call's number for that sample (a resumed sample
    must not draw its first call's tokens again)."""
    return (base * 1_000_003 + prompt * 7919 + index * 104_729 + call * 15_485_863) % (2**31)


@dataclass
class Continuation:
    """The request that continues a sample: the fields of a GenerateRequest that depend on it."""

    request_id: str
    prompt_token_ids: list[int]
    prefix_token_ids: list[int]
    max_tokens: int
    """sampling.max_tokens: the budget of the whole response, prefix included (the server
    generates at most max_tokens - len(prefix_token_ids) more), so a resumed sample ends where an
    uninterrupted one would."""

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.prefix_token_ids)


@dataclass
class Sample:
    """One response to one prompt, built up over one or more /generate calls."""

    group_id: int
    """The prompt's id (PromptItem.uid): samples of one prompt share it (GRPO groups)."""
    index: int
    """Position within the group (0 .. n-1)."""
    prompt_ids: list[int]
    max_tokens: int
    """Response token budget (rollout.sampling.maxTokens)."""
    data_source: str = ""
    route_value: str = ""
    """Value of the routing key (spec.routing.key) that selects the teacher."""
    ground_truth: Any = None
    reward_fn: str | None = None
    """Dotted path of the row's own reward function (reward_model.fn), if it names one."""
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Rollout (behaviour-policy) log-prob of each response token."""
    versions: list[int] = field(default_factory=list)
    """Weight version that sampled each response token."""
    finish_reason: str | None = None
    """None while generating; stop, length, or abort (interrupted, to be resumed)."""
    requests: int = 0
    """/generate calls made so far (1 + resumes)."""
    reward: float | None = None
    teacher: str | None = None
    """Name of the teacher that scored the sample."""
    signals: dict[str, SignalValues] = field(default_factory=dict)
    """What the servers returned per response token beyond the sampled ids, keyed by the loss
    contract's signal names (kubedistill.api.losses.Signal): the rollout's top-k ids when the
    contract asks for them, and the teacher's scores (its full top-k rows as [T, k] arrays)."""
    turn_end: int | None = None
    """A multi-turn trace's current student turn ends once the response has this many tokens
    (None: a single-turn sample, whose one turn ends at max_tokens)."""
    observation_spans: list[list[int]] = field(default_factory=list)
    """A multi-turn trace's observations: [start, end) ranges of the response that the
    environment wrote, not the student (they carry no loss)."""
    turns: int = 0
    """Student turns a multi-turn trace has finished."""
    env_reward: float | None = None
    """The environment's rewards summed over the trace (None: it gave none)."""
    env_error: str | None = None
    """Why the environment ended the trace early (timeout, malformed, gone, http_<code>)."""

    def __post_init__(self) -> None:
        # The token data as arrays for the trainer (batcher.sample_arrays), made once as the sample
        # enters the buffer; not a field, so not in to_dict or checkpoints. Every method that
        # changes the token data drops it.
        self.arrays: SampleArrays | None = None

    @property
    def sample_id(self) -> str:
        return f"{self.group_id}-{self.index}"

    @property
    def request_id(self) -> str:
        """Unique per /generate call, so an abort names exactly one attempt."""
        return f"{self.sample_id}-r{self.requests}"

    @property
    def min_version(self) -> int | None:
        return min(self.versions) if self.versions else None

    @property
    def max_version(self) -> int | None:
        return max(self.versions) if self.versions else None

    @property
    def finished(self) -> bool:
        return self.finish_reason in FINISHED

    @property
    def limit(self) -> int:
        """Where the response's current turn must end: the trace's budget, or its turn's."""
        return self.max_tokens if self.turn_end is None else min(self.turn_end, self.max_tokens)

    def loss_mask(self) -> list[bool] | None:
        """Which response tokens carry loss: None when all do (no observations)."""
        if not self.observation_spans:
            return None
        mask = [True] * len(self.response_ids)
        for start, end in self.observation_spans:
            mask[start:end] = [False] * (end - start)
        return mask

    def add_observation(self, ids: Sequence[int]) -> None:
        """Append an environment's observation to a trace: tokens the student did not sample, with
        log-prob 0 and the version of the turn before them (so they do not change the trace's
        staleness), and a one-id top-k row where the rollout's rows are kept."""
        start = len(self.response_ids)
        version = self.versions[-1] if self.versions else 0
        self.arrays = None
        self.response_ids.extend(int(t) for t in ids)
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([version] * len(ids))
        rows = self.signal(Signal.rollout_topk_ids)
        if rows is not None:  # one-id rows: the trace's rows become lists of their entries
            self.signals[Signal.rollout_topk_ids.value] = _as_lists(rows) + [[int(t)] for t in ids]
        self.observation_spans.append([start, len(self.response_ids)])
        self.finish_reason = None

    @property
    def needs_resume(self) -> bool:
        return self.finish_reason == "abort"

    @property
    def resumed(self) -> int:
        """How many times the sample was continued after an abort."""
        return max(0, self.requests - 1)

    @property
    def scored(self) -> bool:
        return Signal.teacher_logprobs.value in self.signals

    def signal(self, name: Signal) -> SignalValues | None:
        return self.signals.get(name.value)

    def continuation(self) -> Continuation:
        """The next /generate request of this sample (the first one, or a resume after an abort).

        Counts the request: call it once per request actually sent."""
        if self.finished:
            raise ValueError(f"sample {self.sample_id} is finished ({self.finish_reason}); nothing to continue")
        remaining = self.limit - len(self.response_ids)
        if remaining < 1:
            raise ValueError(f"sample {self.sample_id} has no token budget left ({self.limit} used)")
        self.requests += 1
        self.finish_reason = None
        return Continuation(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_ids),
            prefix_token_ids=list(self.response_ids),
            max_tokens=self.limit,
        )

    def extend(self, out: GenerationOutput) -> None:
        """Append the tokens one /generate call produced after the current prefix."""
        ids, lps, vers = list(out.token_ids), list(out.logprobs), list(out.versions)
        if not (len(ids) == len(lps) == len(vers)):
            raise ValueError(
                f"sample {self.sample_id}: generate output has {len(ids)} token_ids, {len(lps)} logprobs and "
                f"{len(vers)} versions; they must be equal"
            )
        if out.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"sample {self.sample_id}: finish_reason {out.finish_reason!r} is not one of {FINISH_REASONS}"
            )
        if len(self.response_ids) + len(ids) > self.limit:
            raise ValueError(
                f"sample {self.sample_id}: {len(self.response_ids)} + {len(ids)} tokens exceed maxTokens {self.limit}"
            )
        topk = out.topk_ids
        if topk is not None and topk.shape[0] != len(ids):
            raise ValueError(
                f"sample {self.sample_id}: generate output has {topk.shape[0]} top-k rows for {len(ids)} tokens"
            )
        rollout_topk = self.signal(Signal.rollout_topk_ids)
        if topk is None and rollout_topk is not None and ids:
            raise ValueError(f"sample {self.sample_id}: a continuation came back without the top-k ids its prefix has")
        self.arrays = None
        self.response_ids.extend(ids)
        # The answer's own lists, of the floats and ints its model checked: no copy per element.
        self.logprobs.extend(lps)
        self.versions.extend(vers)
        if topk is not None:
            self.signals[Signal.rollout_topk_ids.value] = _joined(rollout_topk, topk)
        reason = out.finish_reason
        # An abort that lands exactly on the budget is a finished sample: nothing is left to resume.
        if reason == "abort" and len(self.response_ids) >= self.limit:
            reason = "length"
        self.finish_reason = reason

    def score_input(self) -> tuple[list[int], int]:
        """(token_ids, prompt_len) of the teacher's /score request: prompt followed by response."""
        return list(self.prompt_ids) + list(self.response_ids), len(self.prompt_ids)

    def set_scores(self, teacher: str, out: ScoreOutput) -> None:
        """Store a teacher's /score output (ScoreResponse): one entry per response token. The
        top-k rows stay the arrays they came as (views of the answer's bytes): a held sample
        costs no Python object per number."""
        t = len(self.response_ids)
        lps, ids, tlps = list(out.logprobs), out.topk_ids, out.topk_logprobs
        if not (len(lps) == ids.shape[0] == tlps.shape[0] == t):
            raise ValueError(
                f"sample {self.sample_id}: teacher {teacher} scored {len(lps)} log-probs, {ids.shape[0]} top-k id "
                f"rows and {tlps.shape[0]} top-k log-prob rows for {t} response tokens"
            )
        gathered = out.gather_logprobs
        if gathered is not None:
            held = self.signal(Signal.rollout_topk_ids)
            widths = row_lengths(held if held is not None else [])
            if not np.array_equal(row_lengths(gathered), widths):
                raise ValueError(
                    f"sample {self.sample_id}: teacher {teacher} gathered log-prob rows do not match the "
                    f"rollout's top-k rows ({gathered.shape[0]} rows for {len(widths)})"
                )
        self.teacher = teacher
        self.arrays = None
        self.signals[Signal.teacher_logprobs.value] = [float(x) for x in lps]
        # A request for no top-k (the loss reads none) gets empty rows: nothing to keep.
        for key in (Signal.teacher_topk_ids.value, Signal.teacher_topk_logprobs.value):
            self.signals.pop(key, None)
        if ids.shape[1]:
            self.signals[Signal.teacher_topk_ids.value] = _rows(ids)
            self.signals[Signal.teacher_topk_logprobs.value] = _rows(tlps)
        self.signals.pop(Signal.teacher_logprobs_at_rollout_topk.value, None)
        if gathered is not None:
            self.signals[Signal.teacher_logprobs_at_rollout_topk.value] = _rows(gathered)

    def restart(self) -> None:
        """Forget the tokens generated so far (resume without partial rollouts: start over; a
        trace starts a new episode)."""
        self.response_ids, self.logprobs, self.versions = [], [], []
        self.observation_spans, self.turns, self.turn_end = [], 0, None
        self.env_reward = self.env_error = None
        self.arrays = None
        self.signals.pop(Signal.rollout_topk_ids.value, None)
        self.finish_reason = None
        self.clear_scores()

    def clear_scores(self) -> None:
        self.reward = None
        self.teacher = None
        self.arrays = None
        for name in TEACHER_SIGNALS:
            self.signals.pop(name.value, None)

    def to_dict(self) -> dict[str, Any]:
        """The sample's state as plain values (checkpoints): arrays of rows become lists."""
        d = asdict(self)
        d["signals"] = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in d["signals"].items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        d = _migrate_signals(d)
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"sample state has unknown fields {sorted(unknown)}")
        return cls(**d)


def _rows(rows: Rows) -> SignalValues:
    """A wire answer's rows as the sample keeps them: the array itself when every row is full
    (what a server sends unless its vocabulary is smaller than top-k), else the lists of each
    row's entries."""
    return rows.array() if rows.full else rows.tolist()


def _joined(held: SignalValues | None, rows: Rows) -> SignalValues:
    """A sample's rollout rows with a continuation's appended: one array while every row is full
    and as wide (sampling.top_k_ids is the job's), lists once a row is not (a trace's
    observations)."""
    new = _rows(rows)
    if held is None or len(held) == 0:
        return new
    if len(new) == 0:
        return held
    if isinstance(held, np.ndarray) and isinstance(new, np.ndarray) and held.shape[1] == new.shape[1]:
        both: np.ndarray = np.concatenate([held, new])
        return both
    return _as_lists(held) + _as_lists(new)


def _as_lists(rows: SignalValues) -> list[Any]:
    return rows.tolist() if isinstance(rows, np.ndarray) else list(rows)


def _migrate_signals(d: dict[str, Any]) -> dict[str, Any]:
    """A sample's state as checkpoints before the signals dict stored it: each signal a field of
    its own (None when absent). Those fields move into `signals` under the same names."""
    old = [name.value for name in Signal if name.value in d]
    if not old:
        return d
    d = dict(d)
    signals = dict(d.pop("signals", None) or {})
    for name in old:
        value = d.pop(name)
        if value is not None:
            signals[name] = value
    d["signals"] = signals
    return d


@dataclass
class SampleGroup:
    """The n samples of one prompt: generated, buffered and trained together."""

    group_id: int
    samples: list[Sample]
    images: list[str] | None = None
    """Base64 images of the prompt (vision teachers), kept once per group."""
    arrival: int = -1
    """Order in which the group entered the buffer (set by SampleBuffer)."""

    @classmethod
    def for_prompt(
        cls,
        group_id: int,
        prompt_ids: Sequence[int],
        n: int,
        max_tokens: int,
        *,
        data_source: str = "",
        route_value: str = "",
        ground_truth: Any = None,
        reward_fn: str | None = None,
        images: list[str] | None = None,
    ) -> SampleGroup:
        return cls(
            group_id=group_id,
            images=images,
            samples=[
                Sample(
                    group_id=group_id,
                    index=i,
                    prompt_ids=list(prompt_ids),
                    max_tokens=max_tokens,
                    data_source=data_source,
                    route_value=route_value,
                    ground_truth=ground_truth,
                    reward_fn=reward_fn,
                )
                for i in range(n)
            ],
        )

    @classmethod
    def from_prompt(cls, item: PromptItem, n: int, max_tokens: int) -> SampleGroup:
        """The group of a PromptItem (kubedistill.runtime.driver.data)."""
        return cls.for_prompt(
            item.uid,
            item.prompt_ids,
            n,
            max_tokens,
            data_source=item.data_source,
            route_value=item.route_value,
            ground_truth=item.ground_truth,
            reward_fn=item.reward_fn,
            images=item.images_base64(),
        )

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def min_version(self) -> int | None:
        known = [v for v in (s.min_version for s in self.samples) if v is not None]
        return min(known) if known else None

    @property
    def max_version(self) -> int | None:
        known = [v for v in (s.max_version for s in self.samples) if v is not None]
        return max(known) if known else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "arrival": self.arrival,
            "images": self.images,
            "samples": [s.to_dict() for s in self.samples],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SampleGroup:
        return cls(
            group_id=int(d["group_id"]),
            arrival=int(d.get("arrival", -1)),
            images=d.get("images"),
            samples=[Sample.from_dict(s) for s in d["samples"]],
        )
