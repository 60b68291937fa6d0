"""Task rewards chosen by data_source."""

from __future__ import annotations

import pytest

from kubedistill.runtime.driver import rewards
from kubedistill.runtime.driver.rewards import (
    RewardRegistry,
    UnknownDataSource,
    boxed_reward,
    exact_match_reward,
    gsm8k_answer,
    gsm8k_reward,
    register_reward,
)


def test_gsm8k_hash_answer_and_final_number_fallback() -> None:
    assert gsm8k_reward("She pays 3 * 24 = 72 dollars.\n#### 72", "72") == 1.0
    assert gsm8k_reward("#### 1,000.", "1000") == 1.0
    assert gsm8k_reward("#### $18.00", "18") == 1.0
    assert gsm8k_reward("#### -5", "-5") == 1.0
    assert gsm8k_reward("first 72 then #### 71", "72") == 0.0  # the #### answer wins over other numbers
    assert gsm8k_reward("3 + 4 = 7, so the answer is 12", "12") == 1.0  # no ####: the last number
    assert gsm8k_reward("3 + 4 = 7, so 12 apples", "7") == 0.0
    assert gsm8k_reward("no number at all", "3") == 0.0
    assert gsm8k_answer("#### ") is None


def test_exact_match_and_boxed() -> None:
    assert exact_match_reward(" 52 ", "52") == 1.0
    assert exact_match_reward("520", "52") == 0.0
    assert exact_match_reward("52", None) == 0.0
    assert boxed_reward(r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}") == 1.0
    assert boxed_reward(r"\boxed{3} then \boxed{ 4 }", "4") == 1.0
    assert boxed_reward(r"\boxed{4", "4") == 0.0


def test_registry_routes_by_data_source() -> None:
    reg = RewardRegistry(strict=True, entry_points=False)
    assert reg.score("arith", "52", "52") == 1.0
    assert reg.score("openai/gsm8k", "#### 52", "52") == 1.0
    assert reg.score("synthetic/reverse", "cba", "cba") == 1.0
    assert reg.score("hiyouga/geometry3k", r"\boxed{30}", "30") == 1.0


def test_score_sample_stores_the_reward() -> None:
    from kubedistill.runtime.driver.samples import Sample

    s = Sample(group_id=0, index=0, prompt_ids=[1], max_tokens=4, data_source="arith", ground_truth="52")
    reg = RewardRegistry(strict=True, entry_points=False)
    assert reg.score_sample(s, "52") == 1.0 and s.reward == 1.0
    s.reward_fn = "kubedistill.runtime.driver.rewards.gsm8k_reward"  # dotted form without ':'
    assert reg.score_sample(s, "#### 51") == 0.0 and s.reward == 0.0


def test_unknown_data_source_strict_errors_lenient_counts() -> None:
    strict = RewardRegistry(strict=True, entry_points=False)
    with pytest.raises(UnknownDataSource, match=r"'chat'.*registered patterns: .*gsm8k.*arith"):
        strict.score("chat", "hi", None)
    lenient = RewardRegistry(strict=False, entry_points=False)
    assert lenient.score("chat", "hi", None) is None
    assert lenient.score("chat", "ho", None) is None
    assert lenient.unscored == 2


def test_register_reward_and_row_dotted_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rewards, "_REGISTERED", [])
    register_reward("my_*", lambda response, gt: float(len(response)))
    register_reward("arith", lambda response, gt: 0.25)  # overrides the built-in
    reg = RewardRegistry(strict=True, entry_points=False)
    assert reg.score("my_task", "abc", None) == 3.0
    assert reg.score("arith", "52", "52") == 0.25
    assert reg.patterns[-1] == "my_*" and reg.patterns.count("arith") == 1
    # A row naming its own function wins over data_source.
    assert reg.score("my_task", "#### 9", "9", fn_path="kubedistill.runtime.driver.rewards:gsm8k_reward") == 1.0
    with pytest.raises(ValueError, match="cannot be loaded"):
        reg.score("my_task", "x", None, fn_path="kubedistill.no_such_module:fn")
    with pytest.raises(TypeError, match="callable"):
        register_reward("x", 3)  # type: ignore[arg-type]
