"""The driver with a vision-language student (runtime/driver/loop.py), in-process against the fake
servers of tests/driver_fakes.py: a tiny random Qwen3-VL student (kubedistill/demo/tiny_vl.py, its
real processor) over a dataset mixing the count-the-dots image task and arithmetic text rows
(kubedistill/demo/dots.py `write_mixed`), a text teacher routed to `arith` and a vision teacher
routed to `synthetic/dots`, as in examples/multi-teacher-vl-cpu.yaml.

What is checked: every /generate of an image prompt carries its images and the processor-expanded
ids, a resumed one too, and a text prompt's none; image samples go to the vision teacher with
their images; image rows routed to a text teacher, or given to a text student, fail the job in one
line before anything runs (or, for a teacher the trainer cannot inspect, when its server says it
is text-only); a checkpoint keeps each group's images, and a restored partial rollout resumes
with them."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Literal

import pytest

from driver_fakes import FakeRolloutServer, FakeTeacherServer, rig
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.demo import arith, dots
from kubedistill.runtime.driver.clients import ServerError
from kubedistill.runtime.driver.data import PromptItem, PromptSource
from kubedistill.runtime.driver.multimodal import collapse_runs, load_student_processor, reads_images
from kubedistill.runtime.driver.routing import ImagesToTextTeacher
from kubedistill.runtime.driver.samples import SampleGroup
from kubedistill.runtime.wire.protocol import GenerateResponse, ScoreRequest, ScoreResponse

PADS_PER_IMAGE = 4
"""A 64x64 dots picture: a 4x4 grid of 16-pixel patches, merged 2x2."""


class World:
    """Built once for the module (~5 s): the tiny VL student (also the vision teacher's model
    directory: the driver only reads its config), a text teacher's directory, the mixed data."""

    def __init__(self, base: Path):
        from kubedistill.demo.tiny_vl import build_tiny_vl_model

        self.student = build_tiny_vl_model(base / "student", seed=0)
        self.text_teacher = base / "text-teacher"
        self.text_teacher.mkdir()
        # A text model's config: what the driver reads of a teacher (no vision_config).
        (self.text_teacher / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 512}))
        arith_problems, _ = arith.split(held_out=10)
        self.data = dots.write_mixed(base / "mixed.parquet", arith_problems[:12], dots.problems(12))
        from transformers import AutoProcessor, AutoTokenizer

        self.processor: Any = AutoProcessor.from_pretrained(str(self.student), local_files_only=True)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(self.student), local_files_only=True)
        self.pad = int(self.processor.image_token_id)
        src = PromptSource([self.data], self.tokenizer, processor=self.processor, shuffle=False)
        items = src.take(len(src))
        self.prompts = {tuple(item.prompt_ids) for item in items}
        """Every prompt of the data, as the wire carries it (image prompts: expanded ids)."""
        self.images = {tuple(item.images_base64() or ()) for item in items if item.images}
        """Every image row's images (base64)."""

    def expected(self, spec: DistillationJobSpec, prompts: int = 200) -> dict[int, PromptItem]:
        """The prompts a driver with `spec` draws, by group id (PromptItem.uid)."""
        src = PromptSource.from_spec(spec, self.tokenizer, processor=self.processor)
        return {item.uid: item for item in src.take(prompts)}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("vl-driver"))


def vl_spec(
    world: World,
    tmp_path: Path,
    *,
    steps: int = 4,
    text_sources: list[str] | None = None,
    vision_teacher: bool = True,
    text_teacher: Path | None = None,
    student: Path | None = None,
) -> DistillationJobSpec:
    teachers: list[dict[str, Any]] = [
        {
            "name": "text",
            "model": str(text_teacher or world.text_teacher),
            "match": {"dataSource": text_sources or [arith.DATA_SOURCE]},
        }
    ]
    if vision_teacher:
        teachers.append({"name": "vision", "model": str(world.student), "match": {"dataSource": [dots.DATA_SOURCE]}})
    return DistillationJobSpec.model_validate(
        {
            "mode": "fullyAsync",
            "device": "cpu",
            "student": {"model": str(student or world.student)},
            "teachers": teachers,
            "rollout": {"sampling": {"samplesPerPrompt": 2, "maxTokens": 8, "seed": 3}},
            "trainer": {"miniBatchSize": 4, "totalSteps": steps},
            "async": {"partialRollout": True, "stalenessThreshold": 1.0, "oversample": 2.0},
            "data": {"train": [str(world.data)], "maxPromptLength": 64},
            "checkpoint": {"path": str(tmp_path / "ckpt"), "exportHf": False},
        }
    )


def vl_rig(world: World, spec: DistillationJobSpec, token_seconds: float = 0.003, **kw: Any) -> Any:
    teachers = kw.pop("teachers", None) or {
        "text": [FakeTeacherServer("http://text-0")],
        "vision": [FakeTeacherServer("http://vision-0")],
    }
    rollouts = [FakeRolloutServer(f"http://rollout-{i}", token_seconds=token_seconds) for i in range(2)]
    return rig(spec, rollouts=rollouts, teachers=teachers, tokenizer=world.tokenizer, **kw)


def check_on_the_wire(world: World, prompt_ids: list[int], images: list[str] | None) -> bool:
    """A prompt as the wire carries it: a data row's expanded ids with that row's images, or a
    text prompt with none. Returns whether it is an image prompt."""
    assert tuple(prompt_ids) in world.prompts, "a prompt the data does not hold"
    if images is None:
        assert world.pad not in prompt_ids
        return False
    assert tuple(images) in world.images
    assert prompt_ids.count(world.pad) == PADS_PER_IMAGE * len(images)  # expanded: one pad per merged patch
    assert collapse_runs(prompt_ids, world.pad).count(world.pad) == len(images)
    assert all(base64.b64decode(img).startswith(b"\x89PNG") for img in images)
    return True


def assert_pixels_trained(world: World, trainer: Any) -> None:
    """The trainer got the pixels of every image sample (the batcher makes them through the
    student's processor), and none for a text sample."""
    for step in trainer.steps:
        for b in step:
            for i, ids in enumerate(b.token_ids):
                has_pads = world.pad in ids[: b.prompt_lens[i]]
                assert (b.images is not None and b.images[i] is not None) == has_pads


def group_of(request_id: str) -> int:
    """The group id in a /generate request id (`<group>-<index>-r<n>`)."""
    return int(request_id.split("-")[0])


# ---- the student's processor ---------------------------------------------------------------------
def test_the_processor_is_loaded_for_a_vl_student_only(world: World, tmp_path: Path, monkeypatch) -> None:
    assert reads_images(world.student) is True
    assert reads_images(world.text_teacher) is False
    assert reads_images(tmp_path / "nowhere") is None
    processor = load_student_processor(vl_spec(world, tmp_path))
    assert processor is not None and type(processor).__name__ == "Qwen3VLProcessor"

    import transformers

    def no_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a text student's job loaded a processor")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", no_load)
    assert load_student_processor(vl_spec(world, tmp_path, student=world.text_teacher)) is None


# ---- generation and scoring ----------------------------------------------------------------------
async def test_image_prompts_carry_their_images_and_expanded_ids_resumed_ones_too(world: World, tmp_path) -> None:
    r = vl_rig(world, vl_spec(world, tmp_path, steps=6))
    r.trainer.step_seconds = 0.01
    await r.run()

    assert len(r.trainer.steps) == 6
    requests = [q for s in r.cluster.rollouts.values() for q in s.requests]
    kinds = [check_on_the_wire(world, q.prompt_token_ids, q.images) for q in requests]
    expected = world.expected(r.driver.spec)
    for q in requests:  # each request carries exactly its own row's prompt and images
        item = expected[group_of(q.request_id)]
        assert q.prompt_token_ids == item.prompt_ids and q.images == item.images_base64()
    assert any(kinds) and not all(kinds), "the mixed data gave only one kind of prompt"
    resumed = [q for q, image in zip(requests, kinds) if image and q.prefix_token_ids]
    assert resumed, "no image prompt was resumed across a sync"
    # Scoring: image samples went to the vision teacher with their images, text ones to the text teacher.
    vision, text = r.cluster.teachers["vision"][0].scored, r.cluster.teachers["text"][0].scored
    assert vision and text
    for req in vision:
        assert check_on_the_wire(world, req.token_ids[: req.prompt_len], req.images)
    for req in text:
        assert not check_on_the_wire(world, req.token_ids[: req.prompt_len], req.images)
    assert_pixels_trained(world, r.trainer)


async def test_a_text_student_job_sends_no_images(tmp_path) -> None:
    from driver_fakes import job_spec

    r = rig(job_spec(tmp_path, steps=2))
    assert r.driver.processor is None
    await r.run()
    assert all(q.images is None for s in r.cluster.rollouts.values() for q in s.requests)


# ---- refusals ------------------------------------------------------------------------------------
async def test_image_rows_routed_to_a_text_teacher_fail_before_the_run(world: World, tmp_path) -> None:
    spec = vl_spec(world, tmp_path, text_sources=[arith.DATA_SOURCE, dots.DATA_SOURCE], vision_teacher=False)
    with pytest.raises(ImagesToTextTeacher) as refused:
        vl_rig(world, spec, teachers={"text": [FakeTeacherServer("http://text-0")]})
    message = str(refused.value)
    assert "\n" not in message
    assert f"data_source {dots.DATA_SOURCE!r}" in message and "teacher 'text'" in message
    assert "text-only" in message and "and 11 more row(s)" in message and str(world.text_teacher) in message


async def test_image_rows_for_a_text_student_fail_before_the_run(world: World, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"row \d+ and 11 more row\(s\): images, but the student .* is not a vision-"):
        vl_rig(world, vl_spec(world, tmp_path, student=world.text_teacher))


class TextOnlyTeacher(FakeTeacherServer):
    """A teacher server whose model is text-only: it refuses images as the engines do (400)."""

    async def score(self, req: ScoreRequest) -> ScoreResponse:
        if req.images:
            await self._request()
            raise ServerError(
                self.base_url + "/score", 400, "images: this teacher's model is text-only; images need a VL model"
            )
        return await super().score(req)


async def test_a_teacher_that_answers_text_only_fails_the_run_in_one_line(world: World, tmp_path) -> None:
    # The trainer cannot read this teacher's model directory: it learns only from the server's answer.
    spec = vl_spec(
        world,
        tmp_path,
        text_sources=[arith.DATA_SOURCE, dots.DATA_SOURCE],
        vision_teacher=False,
        text_teacher=tmp_path / "not-mounted-here",
    )
    r = vl_rig(world, spec, teachers={"text": [TextOnlyTeacher("http://text-0")]})
    with pytest.raises(ImagesToTextTeacher) as refused:
        await r.run()
    message = str(refused.value)
    assert "\n" not in message
    assert f"data_source {dots.DATA_SOURCE!r}" in message and "teacher 'text'" in message
    assert "http://text-0 answered that its model is text-only" in message


# ---- checkpoints ---------------------------------------------------------------------------------
def generated(tokens: list[int], finish_reason: Literal["stop", "length", "abort"]) -> GenerateResponse:
    """What a /generate of `tokens` under weight version 0 returns."""
    n = len(tokens)
    return GenerateResponse(
        request_id="r", token_ids=tokens, logprobs=[-1.0] * n, versions=[0] * n, finish_reason=finish_reason
    )


async def test_a_checkpoint_keeps_the_images_and_a_restored_rollout_resumes_with_them(world: World, tmp_path) -> None:
    spec = vl_spec(world, tmp_path, steps=2)
    first = vl_rig(world, spec)
    d = first.driver
    groups = [SampleGroup.from_prompt(d.src.next(), 2, 8) for _ in range(4)]
    image_groups = [g for g in groups if g.images]
    assert image_groups and len(image_groups) < len(groups)
    for g in groups:  # each in flight, its first sample aborted by a sync after 3 tokens
        assert d.buffer.try_reserve(g)
        g.samples[0].continuation()
        g.samples[0].extend(generated([1, 2, 3], "abort"))
    # One image group generated and scored, waiting in the buffer.
    ready = image_groups[0]
    for s in ready.samples:
        if not s.response_ids:
            s.continuation()
        s.extend(generated([4] * (8 - len(s.response_ids)), "length"))
        ids, prompt_len = s.score_input()
        scored = await FakeTeacherServer("http://v").score(ScoreRequest(token_ids=ids, prompt_len=prompt_len))
        s.set_scores("vision", scored)
    await d.buffer.put(ready)
    state = d.driver_state()

    second = vl_rig(world, spec)
    second.driver.restore(0, 0, state)
    restored = {g.group_id: g for g in [*second.driver.buffer.ready_groups(), *second.driver.buffer.in_flight_groups()]}
    assert sorted(restored) == sorted(g.group_id for g in groups)
    for g in groups:
        assert restored[g.group_id].images == g.images
        for s in restored[g.group_id].samples:
            check_on_the_wire(world, s.prompt_ids, g.images)
    await second.run()

    requests = [q for s in second.cluster.rollouts.values() for q in s.requests]
    for g in groups:
        if g is ready:
            assert not any(q.request_id.startswith(f"{g.group_id}-") for q in requests)
            continue
        resumed = [q for q in requests if q.request_id == f"{g.group_id}-0-r2"]
        assert len(resumed) == 1 and resumed[0].prefix_token_ids == [1, 2, 3]
        assert resumed[0].images == g.images and resumed[0].prompt_token_ids == g.samples[0].prompt_ids
    assert any(q.images for q in requests if q.prefix_token_ids)
    trained = [g for line in second.driver.history.lines for g in line["groups"]]
    assert ready.group_id in trained  # restored from the checkpoint, trained with its pixels
    assert_pixels_trained(world, second.trainer)


# ---- the examples --------------------------------------------------------------------------------
def test_the_cpu_twin_routes_as_the_reference_job(root: Path) -> None:
    from kubedistill.api.validate import load_job

    reference = load_job(root / "examples/multi-teacher-6gpu.yaml").spec
    twin = load_job(root / "examples/multi-teacher-vl-cpu.yaml").spec
    # verl's preprocessed GSM8K and Geometry3K rows, unchanged, reach their teachers.
    assert reference.teacher_for("openai/gsm8k").name == "math"
    assert reference.teacher_for("hiyouga/geometry3k").name == "vision"
    assert twin.teacher_for(arith.DATA_SOURCE).name == "text"
    assert twin.teacher_for(dots.DATA_SOURCE).name == "vision"
    for spec in (reference, twin):
        assert spec.mode.value == "fullyAsync" and spec.async_ is not None and spec.async_.partial_rollout
        d = spec.algorithm.distillation
        assert (d.loss_mode.value, d.use_policy_gradient, d.use_task_rewards) == ("k1", True, True)
