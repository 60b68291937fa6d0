"""One contract per loss mode: every LossMode has one, one per-token function, and the API rules,
the engine factory, the batcher and the trainer read their needs from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
from pydantic import ValidationError

from kubedistill.api.losses import CONTRACTS, TOKEN_SIGNALS, PolicyGradient, Signal, active_contract
from kubedistill.api.rules import SPEC_RULES
from kubedistill.api.spec import DistillationJobSpec, LossMode
from kubedistill.api.validate import load_job
from kubedistill.runtime.driver.batcher import BatchRequirements
from kubedistill.runtime.driver.buffer import SampleBuffer
from kubedistill.runtime.driver.samples import Sample
from kubedistill.runtime.driver.staleness import StalenessPolicy
from kubedistill.runtime.engines.factory import rollout_max_logprobs, teacher_max_logprobs
from kubedistill.runtime.trainer import losses as L

ROOT = Path(__file__).resolve().parent.parent


def _spec(mode: LossMode, *, enabled: bool = True, policy_gradient: bool | None = None) -> DistillationJobSpec:
    doc = load_job(ROOT / "examples/quickstart-cpu.yaml").spec.model_dump(by_alias=True, exclude_none=True)
    pg = CONTRACTS[mode].policy_gradient is PolicyGradient.required if policy_gradient is None else policy_gradient
    doc["algorithm"]["distillation"] = {
        "lossMode": mode.value,
        "topK": 5,
        "usePolicyGradient": pg,
        "enabled": enabled,
        "useTaskRewards": not enabled,
    }
    doc["rollout"]["sampling"]["samplesPerPrompt"] = 2
    return DistillationJobSpec.model_validate(doc)


def test_every_loss_mode_has_one_contract_and_one_per_token_function() -> None:
    assert list(CONTRACTS) == list(LossMode)
    assert all(mode is c.mode for mode, c in CONTRACTS.items())
    assert set(L.PER_TOKEN_TERMS) == set(LossMode)


@pytest.mark.parametrize("mode", list(LossMode))
def test_a_contract_reads_its_per_token_signals_and_its_top_k_pair(mode: LossMode) -> None:
    c = CONTRACTS[mode]
    pair = () if c.top_k is None else (c.top_k.ids, c.top_k.logprobs)
    # The reported KL reads the teacher's log-probs under every mode.
    assert Signal.teacher_logprobs in c.signals
    assert set(c.signals) == {s for s in c.signals if s in TOKEN_SIGNALS} | set(pair)
    # The rollout's top-k is asked for exactly when the teacher gathers it and the term sums over it.
    assert c.rollout_top_k == c.teacher_gather == (c.top_k is not None and c.top_k.ids is Signal.rollout_topk_ids)
    assert not (c.batch_mean_baseline and c.top_k is not None), "a baseline is computed from per-token signals"


@pytest.mark.parametrize("mode", list(LossMode))
@pytest.mark.parametrize("policy_gradient", [False, True])
def test_api_rules_follow_the_contract(mode: LossMode, policy_gradient: bool) -> None:
    allowed = {
        PolicyGradient.required: policy_gradient,
        PolicyGradient.allowed: True,
        PolicyGradient.forbidden: not policy_gradient,
    }[CONTRACTS[mode].policy_gradient]
    if allowed:
        _spec(mode, policy_gradient=policy_gradient)
        return
    with pytest.raises(ValidationError, match=f"lossMode {mode.value}.*usePolicyGradient"):
        _spec(mode, policy_gradient=policy_gradient)
    pg_rules = [r for r in SPEC_RULES if r.field == ".algorithm.distillation.usePolicyGradient"]
    assert [f"'{mode.value}'" in r.cel for r in pg_rules].count(True) == 1


@pytest.mark.parametrize("mode", list(LossMode))
def test_servers_are_asked_for_what_the_contract_reads(mode: LossMode) -> None:
    c = CONTRACTS[mode]
    spec = _spec(mode)
    req = BatchRequirements.from_spec(spec)
    assert req.contract is c and req.teacher_scores
    assert rollout_max_logprobs(spec) == req.rollout_top_k == (5 if c.rollout_top_k else 0)
    assert req.teacher_top_k == (5 if c.teacher_top_k else 0)
    assert teacher_max_logprobs(spec) == (-1 if c.teacher_gather else req.teacher_top_k)
    off = _spec(mode, enabled=False)
    assert active_contract(off.algorithm.distillation) is None
    assert BatchRequirements.from_spec(off).teacher_scores is False
    assert (rollout_max_logprobs(off), teacher_max_logprobs(off)) == (0, 0)


def _old_sample_state() -> dict[str, Any]:
    """A finished, scored sample as checkpoints stored it before the signals dict: each signal a
    field of its own."""
    return {
        "group_id": 7,
        "index": 0,
        "prompt_ids": [1, 2],
        "max_tokens": 4,
        "data_source": "arith",
        "route_value": "arith",
        "ground_truth": "5",
        "reward_fn": None,
        "response_ids": [5, 6],
        "logprobs": [-0.5, -0.25],
        "versions": [3, 3],
        "rollout_topk_ids": [[5, 9], [6, 9]],
        "finish_reason": "stop",
        "requests": 1,
        "reward": 1.0,
        "teacher": "math",
        "teacher_logprobs": [-0.1, -0.2],
        "teacher_topk_ids": [[5], [6]],
        "teacher_topk_logprobs": [[-0.1], [-0.2]],
        "teacher_logprobs_at_rollout_topk": None,
    }


def test_a_checkpointed_sample_of_the_old_shape_loads() -> None:
    s = Sample.from_dict(_old_sample_state())
    assert s.signals == {
        "rollout_topk_ids": [[5, 9], [6, 9]],
        "teacher_logprobs": [-0.1, -0.2],
        "teacher_topk_ids": [[5], [6]],
        "teacher_topk_logprobs": [[-0.1], [-0.2]],
    }
    assert s.scored and Sample.from_dict(s.to_dict()) == s

    rule = StalenessPolicy.build(
        mode="sync", group_size=1, mini_batch_size=1, staleness_threshold=0.0, trigger_parameter_sync_step=1
    )
    buf = SampleBuffer(rule)
    state = buf.state_dict()
    state["ready"] = [{"group_id": 7, "arrival": 0, "images": None, "samples": [_old_sample_state()]}]
    buf.load_bytes(msgpack.packb(state, use_bin_type=True))
    assert buf.state_dict()["ready"][0]["samples"][0]["signals"] == s.signals


def _module_imports(path: Path) -> set[str]:
    """The kubedistill.api modules a module imports when it is loaded: module level, outside
    `if TYPE_CHECKING:` (function-level imports are how a cycle hides, so they count too)."""
    import ast

    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    return {
        n.module.removeprefix("kubedistill.api.")
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and id(n) not in skip and (n.module or "").startswith("kubedistill.api.")
    }


def test_the_api_modules_import_each_other_without_a_cycle() -> None:
    api = ROOT / "kubedistill" / "api"
    graph = {p.stem: _module_imports(p) for p in api.glob("*.py") if p.stem != "__init__"}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module in done:
            return
        for dep in graph.get(module, ()):
            visit(dep, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())
