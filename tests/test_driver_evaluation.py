"""Held-out evaluation during the job (runtime/driver/evaluation.py) through the driver's real loop
against the fake servers of tests/driver_fakes.py: when it runs, which weights it uses, what it
reports and where (history, /status, gauges)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from driver_fakes import ALPHABET, FakeRolloutServer, FakeTrainer, job_spec, logprob_of, rig, token_at
from e2e_jobs import write_prompts
from kubedistill.runtime.driver.best import BEST_DIR, EVAL_META, BestKeeper, better
from kubedistill.runtime.driver.evaluation import EvalResult, EvalSchedule, HeldOutSample, SourceScores, summarize
from kubedistill.runtime.metrics import RoleMetrics

MAX_TOKENS = 3


def write_val(path: Path, rows: int = 8) -> Path:
    """Held-out arithmetic rows; the even ones' ground truth is what the fake rollout server
    answers (its tokens depend only on the prompt), the odd ones' is not: a score of 0.5."""
    with path.open("w") as f:
        for i in range(rows):
            prompt = f"{i:02d}+{i + 1:02d}="
            ids = [ALPHABET.index(c) for c in prompt]
            answer = "".join(ALPHABET[token_at(ids, p)] for p in range(MAX_TOKENS))
            f.write(
                json.dumps(
                    {
                        "data_source": "arith" if i < rows // 2 else "synthetic/other",
                        "prompt": [{"role": "user", "content": prompt}],
                        "reward_model": {"ground_truth": answer if i % 2 == 0 else "x"},
                    }
                )
                + "\n"
            )
    return path


def eval_spec(tmp_path: Path, evaluation: dict[str, Any], **kw: Any) -> Any:
    data = {
        "train": [str(write_prompts(tmp_path / "train.jsonl", 16))],
        "val": [str(write_val(tmp_path / "val.jsonl"))],
    }
    return job_spec(tmp_path, max_tokens=MAX_TOKENS, evaluation=evaluation, data=data, **kw)


def test_the_schedule_is_before_the_first_step_every_n_and_the_last() -> None:
    s = EvalSchedule(every_steps=3, before_first_step=True, total_steps=7)
    assert [step for step in range(8) if s.due(step)] == [0, 3, 6, 7]
    s = EvalSchedule(every_steps=None, before_first_step=False, total_steps=5)
    assert [step for step in range(6) if s.due(step)] == [5]


def test_scores_are_per_data_source_and_the_kl_is_token_weighted() -> None:
    samples = [
        HeldOutSample("a", "t", 1.0, 2, -1.0),
        HeldOutSample("a", "t", 0.0, 6, 3.0),
        HeldOutSample("b", None, None, 4),
    ]
    out = summarize(samples, {"a": 1, "b": 1})
    assert out["a"].score == 0.5 and out["a"].response_length == 4.0
    assert out["a"].reverse_kl == pytest.approx(2.0 / 8)
    assert out["b"].score is None and out["b"].reverse_kl is None and out["b"].teacher is None


@pytest.mark.parametrize(
    ("mode", "asyncspec"),
    [
        ("sync", None),
        ("fullyAsync", {"stalenessThreshold": 1.0, "partialRollout": True, "partialRolloutStrategy": "inflight"}),
        ("fullyAsync", {"stalenessThreshold": 1.0, "partialRollout": True, "triggerParameterSyncStep": 2}),
    ],
)
async def test_each_evaluation_uses_the_weights_of_its_step_and_shows_everywhere(tmp_path, mode, asyncspec) -> None:
    every = 2
    spec = eval_spec(
        tmp_path,
        {"everySteps": every, "scoreWithTeachers": True, "samplesPerPrompt": 2},
        mode=mode,
        steps=5,
        asyncspec=asyncspec,
    )
    metrics = RoleMetrics("job", "trainer", 0)
    servers = [FakeRolloutServer(f"http://rollout-{i}", token_seconds=0.001) for i in range(2)]
    r = rig(spec, rollouts=servers, metrics=metrics)
    r.trainer.step_seconds = 0.01
    await r.run()

    trigger = r.driver.staleness_policy.trigger_parameter_sync_step
    results = r.driver.evaluator.results if r.driver.evaluator else []
    assert [e.step for e in results] == [0, 2, 4, 5]
    # The version each evaluation used is the one synced after its step; the last step was synced
    # for its evaluation although no training follows it.
    synced_after = {0: 0, **{step: step // trigger for step in (2, 4)}, 5: 4 // trigger + 1}
    assert [(e.step, e.weight_version) for e in results] == list(synced_after.items())
    assert r.sender.syncs[-1][0] == synced_after[5]
    held_out = [
        req for s in servers for req in s.requests if req.request_id.startswith("eval-")
    ]  # 8 prompts x 2 samples per evaluation
    assert len(held_out) == 4 * 16
    assert all(req.sampling.temperature == 0.0 and req.sampling.max_tokens == MAX_TOKENS for req in held_out)
    eval_answers = [a for s in servers for a in s.answers if a.request_id.startswith("eval-")]
    for e in results:
        for name, src in e.sources.items():
            assert src.score == 0.5, (e.step, name)
            assert src.response_length == MAX_TOKENS and src.samples == 8 and src.prompts == 4
            # fake log-probs: the student's encode the version, the teacher's are -0.5
            assert src.reverse_kl == pytest.approx(logprob_of(e.weight_version) + 0.5)
            assert src.teacher == "arith"
    assert sorted({v for a in eval_answers for v in a.versions}) == sorted({e.weight_version for e in results})

    lines = r.driver.history.lines
    in_history = [ev["step"] for line in lines for ev in line.get("evaluations", [])]
    assert in_history == [0, 2, 4, 5]
    assert lines[-1]["evaluations"][-1]["step"] == 5  # the last line carries the final one
    assert lines[-1]["evaluation"]["step"] == 5  # and its status part says so
    assert all(line["phases"]["eval"] >= 0.0 for line in lines)
    status = r.driver.status.to_json()["evaluation"]
    assert status["step"] == 5 and status["score"] == 0.5
    assert set(status["sources"]) == {"arith", "synthetic/other"}
    labels = {"job": "job", "role": "trainer", "replica": "0", "data_source": "arith", "teacher": "arith"}
    assert metrics.registry.get_sample_value("kubedistill_eval_score", labels) == 0.5
    assert metrics.registry.get_sample_value("kubedistill_eval_response_length", labels) == MAX_TOKENS
    kl = metrics.registry.get_sample_value("kubedistill_eval_reverse_kl", labels)
    assert kl == pytest.approx(logprob_of(results[-1].weight_version) + 0.5)
    assert (
        metrics.registry.get_sample_value("kubedistill_eval_step", {k: labels[k] for k in ("job", "role", "replica")})
        == 5
    )


async def test_the_first_n_prompts_once_without_teachers_and_no_step_zero(tmp_path) -> None:
    spec = eval_spec(tmp_path, {"beforeFirstStep": False, "prompts": 3, "maxTokens": 2, "temperature": 1.0}, steps=3)
    r = rig(spec)
    await r.run()
    results = r.driver.evaluator.results if r.driver.evaluator else []
    assert [e.step for e in results] == [3]
    held_out = [req for s in r.cluster.rollouts.values() for req in s.requests if req.request_id.startswith("eval-")]
    assert sorted(req.prompt_token_ids[:2] for req in held_out) == [[0, 0], [0, 1], [0, 2]]
    assert all(req.sampling.max_tokens == 2 and req.sampling.temperature == 1.0 for req in held_out)
    prompts = {tuple(req.prompt_token_ids) for req in held_out}
    scored = [tuple(req.token_ids[: req.prompt_len]) for s in r.cluster.teachers["arith"] for req in s.scored]
    assert scored and not prompts & set(scored)  # the teachers scored training samples only
    assert all(src.reverse_kl is None and src.teacher is None for src in results[0].sources.values())


def _result(step: int, score: float | None) -> EvalResult:
    sources = {"arith": SourceScores(prompts=1, samples=1, score=score, response_length=1.0)}
    return EvalResult(step, step, 0.1, sources)


def test_the_best_export_is_replaced_only_by_a_better_score_and_survives_a_restart(tmp_path) -> None:
    keeper = BestKeeper(tmp_path)

    def export(step: int) -> None:
        keeper.candidate(step).mkdir()
        (keeper.candidate(step) / "model").write_text(str(step))

    for step, score, kept in [(0, 0.4, True), (10, 0.3, False), (20, 0.5, True), (30, 0.5, False), (40, None, False)]:
        export(step)
        assert keeper.finished(_result(step, score)) is kept
        assert not keeper.candidate(step).exists()
    best = tmp_path / BEST_DIR
    assert (best / "model").read_text() == "20"
    assert json.loads((best / EVAL_META).read_text()) == {"step": 20, "weightVersion": 20, "score": 0.5}
    assert sorted(p.name for p in tmp_path.iterdir()) == [BEST_DIR]
    # A restarted trainer compares with the kept score and drops candidates left half-way.
    export(50)
    again = BestKeeper(tmp_path)
    assert again.best == 0.5 and not again.candidate(50).exists()
    assert better(0.6, again.best) and not better(0.5, again.best) and not better(None, None)


async def test_keep_best_exports_each_evaluated_student_and_keeps_the_best(tmp_path) -> None:
    spec = eval_spec(tmp_path, {"everySteps": 2, "keepBest": True}, steps=4)

    class ExportingTrainer(FakeTrainer):
        def export_hf(self, out_dir: str | Path) -> Path | None:
            Path(out_dir).mkdir(parents=True)
            (Path(out_dir) / "trained-steps").write_text(str(len(self.steps)))
            return super().export_hf(out_dir)

    r = rig(spec, trainer=ExportingTrainer())
    await r.run()
    root = tmp_path / "ckpt"
    # The weights of steps 0, 2 and 4, each exported before its evaluation; every score ties at 0.5,
    # so the first stays the best.
    assert [p.name for p in r.trainer.exported] == [f".student-hf-eval-{s:08d}" for s in (0, 2, 4)]
    assert (root / BEST_DIR / "trained-steps").read_text() == "0"
    assert json.loads((root / BEST_DIR / EVAL_META).read_text())["step"] == 0
    assert sorted(p.name for p in root.iterdir()) == [BEST_DIR]


async def test_image_rows_are_evaluated_with_their_images() -> None:
    """A VL row's held-out requests carry its images, to the rollout server and to the teacher."""
    from kubedistill.api.spec import EvaluationSpec, SamplingSpec
    from kubedistill.runtime.driver.data import PromptItem
    from kubedistill.runtime.driver.evaluation import Evaluator
    from kubedistill.runtime.driver.rewards import RewardRegistry
    from kubedistill.runtime.wire.protocol import GenerateRequest, GenerateResponse, ScoreRequest, ScoreResponse
    from kubedistill.runtime.wire.rows import Rows

    image = b"\x89PNG fake"
    item = PromptItem(
        uid=0, row=0, epoch=0, prompt_ids=[1, 2, 3], messages=[], data_source="geo3k", route_value="geo3k",
        ground_truth="5", images=[{"bytes": image}],
    )  # fmt: skip
    generated: list[GenerateRequest] = []
    scored: list[ScoreRequest] = []

    async def generate(req: GenerateRequest) -> GenerateResponse:
        generated.append(req)
        return GenerateResponse(
            request_id=req.request_id, token_ids=[5], logprobs=[-0.5], versions=[3], finish_reason="stop"
        )

    async def score(route: str, source: str, req: ScoreRequest) -> tuple[str, ScoreResponse]:
        scored.append(req)
        return "vision", ScoreResponse(
            logprobs=[-1.5], topk_ids=Rows.of([[]], "int32"), topk_logprobs=Rows.of([[]], "float32")
        )

    class Digits:
        def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
            return "\\\\boxed{" + "".join(map(str, ids)) + "}"

    done = []
    evaluator = Evaluator(
        EvaluationSpec(scoreWithTeachers=True),
        [item],
        sampling=SamplingSpec(maxTokens=8),
        tokenizer=Digits(),  # type: ignore[arg-type]
        rewards=RewardRegistry(strict=False),
        generate=generate,
        score=score,
        on_result=done.append,
    )
    evaluator.start(6, 3)
    await evaluator.settle()
    [result] = done
    assert [r.images for r in generated] == [item.images_base64()] and generated[0].images
    assert [r.images for r in scored] == [item.images_base64()] and scored[0].token_ids == [1, 2, 3, 5]
    geo = result.sources["geo3k"]
    assert (geo.score, geo.reverse_kl, geo.teacher) == (1.0, 1.0, "vision")


async def test_held_out_requests_end_and_draw_as_the_rollouts_do() -> None:
    """spec.rollout.sampling's stop, stopTokenIds, repetitionPenalty, topK and topP reach every
    held-out request (an answer ends where a training one would); the temperature and maxTokens are
    spec.evaluation's own."""
    from kubedistill.api.spec import EvaluationSpec, SamplingSpec
    from kubedistill.runtime.driver.data import PromptItem
    from kubedistill.runtime.driver.evaluation import Evaluator
    from kubedistill.runtime.driver.rewards import RewardRegistry
    from kubedistill.runtime.wire.protocol import GenerateRequest, GenerateResponse

    item = PromptItem(
        uid=0, row=0, epoch=0, prompt_ids=[1, 2], messages=[], data_source="arith", route_value="arith",
        ground_truth="5",
    )  # fmt: skip
    generated: list[GenerateRequest] = []

    async def generate(req: GenerateRequest) -> GenerateResponse:
        generated.append(req)
        return GenerateResponse(
            request_id=req.request_id, token_ids=[5], logprobs=[-0.5], versions=[3], finish_reason="stop"
        )

    class Digits:
        def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
            return "".join(map(str, ids))

    rollout = SamplingSpec(
        maxTokens=64, temperature=0.7, stop=["</answer>"], stopTokenIds=[7, 9], repetitionPenalty=1.3, topK=5, topP=0.8
    )
    evaluator = Evaluator(
        EvaluationSpec(maxTokens=16),
        [item],
        sampling=rollout,
        tokenizer=Digits(),  # type: ignore[arg-type]
        rewards=RewardRegistry(strict=False),
        generate=generate,
        score=None,
        on_result=lambda _: None,
    )
    evaluator.start(6, 3)
    await evaluator.settle()
    [req] = generated
    s = req.sampling
    assert (s.stop, s.stop_token_ids, s.repetition_penalty, s.top_k, s.top_p) == (["</answer>"], [7, 9], 1.3, 5, 0.8)
    assert (s.temperature, s.max_tokens) == (0.0, 16)
