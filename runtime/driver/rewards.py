"""Task rewards, chosen by a sample's data_source (verl's convention). Pure functions of the
decoded response text and the row's `reward_model.ground_truth`.

Built in:
* GSM8K (`gsm8k`, `openai/gsm8k`): 1.0 if the number after the last `####` equals the ground
  truth numerically (commas, `$`, a trailing `.` ignored). With no `####` in the response the
  *last number* in it is taken instead: small or lightly tuned students rarely keep the exact
  format, and a correct final number is the answer they meant. 0.0 otherwise.
* Exact match (`arith`, the quickstart's digit arithmetic, and any `synthetic/*`): 1.0 if the
  stripped response equals the stripped ground truth.
* Boxed answers (`geo3k`, `hiyouga/geometry3k`, `math`, `lighteval/MATH`): the content of the last
  `\\boxed{...}` equals the ground truth after whitespace and `$` are removed.

More rewards, three ways (the first that applies wins):
1. the row names one: `reward_model.fn: "package.module:function"` (imported once, cached);
2. `register_reward("my_source*", fn)` in code that runs before the driver (fnmatch patterns,
   later registrations take precedence over earlier ones and over the built-ins);
3. an installed package's entry point in group `kubedistill.rewards`: the entry's name is the
   data_source pattern, its value the function.
A reward function is `fn(response: str, ground_truth) -> float`.

Unknown data_source: with task rewards in the loss (`useTaskRewards: true`) it is an error that
lists the registered patterns: training on silent zeros would be worse than stopping. Without
them the reward is only a metric, so the sample gets no reward (None) and the miss is counted
in `RewardRegistry.unscored`.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubedistill.api.spec import DistillationJobSpec
    from kubedistill.runtime.driver.samples import Sample

RewardFn = Callable[[str, Any], float]
ENTRY_POINT_GROUP = "kubedistill.rewards"

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _to_decimal(text: str) -> Decimal | None:
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return Decimal(cleaned)
    except (InvalidOperation, ValueError):
        return None


def gsm8k_answer(response: str) -> str | None:
    """The answer a response gives: the number after the last `####`, else its last number."""
    if "####" in response:
        tail = response.rsplit("####", 1)[1]
        found = _NUMBER.search(tail)
        return found.group(0) if found else None
    numbers: list[str] = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def gsm8k_reward(response: str, ground_truth: Any) -> float:
    answer = gsm8k_answer(response)
    if answer is None or ground_truth is None:
        return 0.0
    got, want = _to_decimal(answer), _to_decimal(str(ground_truth))
    return 1.0 if got is not None and want is not None and got == want else 0.0


def exact_match_reward(response: str, ground_truth: Any) -> float:
    return 1.0 if ground_truth is not None and response.strip() == str(ground_truth).strip() else 0.0


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def boxed_reward(response: str, ground_truth: Any) -> float:
    got = last_boxed(response)
    if got is None or ground_truth is None:
        return 0.0

    def norm(s: str) -> str:
        return re.sub(r"\s+|\$", "", s)

    return 1.0 if norm(got) == norm(str(ground_truth)) else 0.0


BUILTINS: list[tuple[str, RewardFn]] = [
    ("gsm8k", gsm8k_reward),
    ("openai/gsm8k", gsm8k_reward),
    ("arith", exact_match_reward),
    ("synthetic/*", exact_match_reward),
    ("geo3k", boxed_reward),
    ("hiyouga/geometry3k", boxed_reward),
    ("math", boxed_reward),
    ("lighteval/MATH", boxed_reward),
]

_REGISTERED: list[tuple[str, RewardFn]] = []


def register_reward(data_source_pattern: str, fn: RewardFn) -> None:
    """Score samples whose data_source matches `data_source_pattern` (fnmatch) with `fn`.
    Affects registries created afterwards."""
    if not callable(fn):
        raise TypeError(f"register_reward({data_source_pattern!r}, ...): fn must be callable")
    _REGISTERED.append((data_source_pattern, fn))


def load_dotted(path: str) -> RewardFn:
    """`package.module:function` (or `package.module.function`) -> the function."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"reward function {path!r} must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward function {path!r} cannot be loaded: {e}") from None
    if not callable(fn):
        raise ValueError(f"reward function {path!r} is not callable")
    reward_fn: RewardFn = fn
    return reward_fn


def _entry_point_rewards() -> list[tuple[str, RewardFn]]:
    from importlib.metadata import entry_points

    found = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.append((ep.name, ep.load()))
    return found


class UnknownDataSource(LookupError):
    pass


class RewardRegistry:
    """Resolves a data_source to its reward function and scores responses."""

    def __init__(self, strict: bool, extra: list[tuple[str, RewardFn]] | None = None, entry_points: bool = True):
        self.strict = strict
        """True when task rewards train the model: an unknown data_source is an error."""
        ordered = list(BUILTINS)
        if entry_points:
            ordered += _entry_point_rewards()
        ordered += _REGISTERED + list(extra or [])
        self._rules = list(reversed(ordered))  # the latest registration wins
        self._dotted: dict[str, RewardFn] = {}
        self.unscored = 0
        """Samples left without a reward because no function matched (strict=False only)."""

    @classmethod
    def for_spec(cls, spec: DistillationJobSpec) -> RewardRegistry:
        return cls(strict=bool(spec.algorithm.distillation.use_task_rewards))

    @property
    def patterns(self) -> list[str]:
        seen: list[str] = []
        for p, _ in reversed(self._rules):
            if p not in seen:
                seen.append(p)
        return seen

    def resolve(self, data_source: str, fn_path: str | None = None) -> RewardFn | None:
        if fn_path:
            if fn_path not in self._dotted:
                self._dotted[fn_path] = load_dotted(fn_path)
            return self._dotted[fn_path]
        for pattern, fn in self._rules:
            if fnmatch.fnmatchcase(data_source, pattern):
                return fn
        return None

    def score(self, data_source: str, response: str, ground_truth: Any, fn_path: str | None = None) -> float | None:
        fn = self.resolve(data_source, fn_path)
        if fn is None:
            if self.strict:
                raise UnknownDataSource(
                    f"no reward function for data_source {data_source!r}; registered patterns: "
                    f"{', '.join(self.patterns)} (add one with register_reward, a "
                    f"'{ENTRY_POINT_GROUP}' entry point or reward_model.fn in the data row)"
                )
            self.unscored += 1
            return None
        return float(fn(response, ground_truth))

    def score_sample(self, sample: Sample, response_text: str) -> float | None:
        """Score a Sample (kubedistill.runtime.driver.samples) from its decoded response text
        (`tokenizer.decode(sample.response_ids, skip_special_tokens=True)`) and store the reward."""
        sample.reward = self.score(sample.data_source, response_text, sample.ground_truth, sample.reward_fn)
        return sample.reward
