"""A vision-language student on the trainer (a tiny random Qwen3-VL, built once here): image and
text samples in one step, their log-probs against plain transformers (the trainer's half of the
lag-0 criterion), micro-batching and packing that keep images with their samples, freezeVision,
two FSDP ranks against one, the weights' HF names, the export, and images from the driver's
base64 to the batch through the student's processor."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from batch_lists import to_lists
from kubedistill.api.losses import CONTRACTS, TEACHER_TOP_K
from kubedistill.api.spec import LossMode
from kubedistill.runtime.trainer import Trainer
from kubedistill.runtime.trainer.microbatch import (
    collate,
    micro_batch_rows,
    mrope_positions,
    plan_step,
    vision_lockstep,
)
from kubedistill.runtime.wire.batch import SampleImages, TrainBatch
from trainer_cases import make_batch, make_spec, run_ranks, saved_batch_path

torch.set_num_threads(1)

K = 3  # make_spec's forwardKLTopK width


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kubedistill.demo.tiny_vl import build_tiny_vl_model

    return build_tiny_vl_model(tmp_path_factory.mktemp("vl") / "student", seed=0)


@pytest.fixture(scope="module")
def processor(student: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(student))


def dots(width: int, height: int, n: int) -> Any:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    for k in range(n):
        draw.ellipse((4 + 11 * k, 6 + 7 * k, 12 + 11 * k, 14 + 7 * k), fill=(20 * k, 0, 0))
    return img


def b64_png(img: Any) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def image_prompt(processor: Any, images: list[Any], text: str) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Expanded prompt ids of a chat message with `images` then `text`, and the processor's tensors."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    rendered = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
    out = processor(text=[rendered], images=images, return_tensors="pt")
    return out["input_ids"][0].tolist(), out


def mixed_batch(processor: Any, seed: int = 0) -> tuple[TrainBatch, list[dict[str, torch.Tensor] | None]]:
    """Image and text samples interleaved (a long text sample first, two images in one sample),
    with every signal forwardKLTopK reads; and each sample's processor tensors (None: text)."""
    g = torch.Generator().manual_seed(seed)
    vocab = len(processor.tokenizer)

    def tokens(n: int) -> list[int]:
        return torch.randint(20, vocab - 16, (n,), generator=g).tolist()

    tok = processor.tokenizer
    prompts: list[tuple[list[int], dict[str, torch.Tensor] | None]] = [
        (tok("how many dots are in the picture? answer with one digit and then count again").input_ids, None),
        image_prompt(processor, [dots(64, 64, 2)], "how many dots?"),
        image_prompt(processor, [dots(96, 64, 3), dots(64, 128, 1)], "count"),
        (tok("12+34=").input_ids, None),
    ]
    resp = [6, 5, 7, 4]
    token_ids = [p + tokens(r) for (p, _), r in zip(prompts, resp)]

    def lps(r: int) -> list[float]:
        return (-torch.rand(r, generator=g) * 3).tolist()

    topk = [[torch.randperm(vocab - 20, generator=g)[:K].add(20).tolist() for _ in range(r)] for r in resp]
    batch = TrainBatch(
        token_ids=token_ids,
        prompt_lens=[len(p) for p, _ in prompts],
        rollout_logprobs=[lps(r) for r in resp],
        signals={
            "teacher_logprobs": [lps(r) for r in resp],
            "teacher_topk_ids": topk,
            "teacher_topk_logprobs": [[sorted(lps(K), reverse=True) for _ in range(r)] for r in resp],
        },
        images=[
            None if out is None else SampleImages(out["pixel_values"].float().numpy(), out["image_grid_thw"].numpy())
            for _, out in prompts
        ],
    )
    return batch, [out for _, out in prompts]


def reference_logprobs(
    model: Any, batch: TrainBatch, inputs: list[dict[str, torch.Tensor] | None], i: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample i alone through a plain transformers forward with its processor inputs: the
    log-probs of its response tokens and at its top-k ids."""
    ids = torch.tensor([batch.token_ids[i]])
    p, out = batch.prompt_lens[i], inputs[i]
    kw: dict[str, torch.Tensor] = {}
    if out is not None:
        types = torch.zeros_like(ids, dtype=out["mm_token_type_ids"].dtype)
        types[:, :p] = out["mm_token_type_ids"]
        kw = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"], "mm_token_type_ids": types}
    with torch.no_grad():
        rows = model(input_ids=ids, **kw).logits[0].float().log_softmax(-1)[p - 1 : ids.shape[1] - 1]
    token = rows.gather(-1, ids[0, p:, None]).squeeze(-1)
    return token, rows.gather(-1, torch.tensor(batch.signals["teacher_topk_ids"][i]))


def spec(student: Path, ckpt: Path, **overrides: Any) -> Any:
    return make_spec(student, ckpt, **{"trainer.optim.lr": 1e-2, **overrides})


@pytest.mark.parametrize(
    "rows", [[[0], [1], [2], [3]], [[0, 3], [2, 1]], [[2, 0, 3, 1]]], ids=["padded", "packed", "one-row"]
)
def test_log_probs_of_image_and_text_samples_match_transformers(
    student: Path, processor: Any, tmp_path: Path, rows: list[list[int]]
) -> None:
    """Lag 0, the trainer's half: mixed in one micro-batch, padded or packed, every sampled
    token's log-prob (and the top-k ones) equals a plain forward of its sample alone."""
    from transformers import AutoModelForImageTextToText

    batch, inputs = mixed_batch(processor)
    trainer = Trainer(spec(student, tmp_path / "ckpt"))
    try:
        assert trainer.pack and trainer.model.vision is not None
        tensors = batch.to_tensors()
        mb = collate(
            tensors,
            rows,
            torch.ones(sum(tensors.response_lens)),
            None,
            0,
            top_k=TEACHER_TOP_K,
            vision=trainer.model.vision,
        )
        assert mb.position_ids is not None and mb.position_ids.shape[0] == 4  # text row + M-RoPE t/h/w
        with torch.no_grad():
            got, got_topk = trainer._forward(mb)
    finally:
        trainer.close()
    reference = AutoModelForImageTextToText.from_pretrained(str(student), dtype=torch.float32).eval()
    want = [reference_logprobs(reference, batch, inputs, i) for row in rows for i in row]
    assert torch.allclose(got, torch.cat([w[0] for w in want]), atol=1e-5, rtol=0)
    assert torch.allclose(got_topk, torch.cat([w[1] for w in want]), atol=1e-5, rtol=0)
    # The positions are the model's own (its get_rope_index), image by image.
    i = 2
    ids = torch.tensor(batch.token_ids[i])
    grid = torch.from_numpy(batch.images[i].grid_thw)
    theirs, _ = reference.model.get_rope_index(
        ids[None], mm_token_type_ids=(ids == reference.config.image_token_id).int()[None], image_grid_thw=grid
    )
    assert torch.equal(mrope_positions(ids, grid, trainer.model.vision), theirs[:, 0])


def _step(trainer: Trainer, batch: TrainBatch) -> tuple[Any, dict[str, torch.Tensor]]:
    try:
        stats = trainer.step(batch.to_parts())
        return stats, {n: w.clone() for n, w in trainer.named_full_weights()}
    finally:
        trainer.close()


def test_micro_batches_and_sample_order_do_not_change_the_step(student: Path, processor: Any, tmp_path: Path) -> None:
    """One micro-batch per sample vs everything packed in one, and the batch in another order:
    the same loss, gradient norm and weights (each sample's images travel with it)."""
    from safetensors.torch import load_file

    # AdamW's first step moves a weight by lr * g / (|g| + eps): at the default eps (1e-8) that is
    # lr * sign(g), so summation-order noise on a gradient entry near zero flips a whole lr-sized
    # move (a deepstack merger weight did, 1 run in ~10). An eps above the noise keeps the update
    # continuous in g, and equal gradients then give equal weights to well below 1e-5.
    adam = {"trainer.optim.eps": 1e-3}
    batch, _ = mixed_batch(processor)
    small = _step(Trainer(spec(student, tmp_path / "a", **{"trainer.microBatchTokens": 8}, **adam)), batch)
    large = _step(Trainer(spec(student, tmp_path / "b", **{"trainer.microBatchTokens": 100000}, **adam)), batch)
    order = [3, 2, 0, 1]
    moved = TrainBatch(
        token_ids=[batch.token_ids[i] for i in order],
        prompt_lens=[batch.prompt_lens[i] for i in order],
        rollout_logprobs=[batch.rollout_logprobs[i] for i in order],
        signals={k: [v[i] for i in order] for k, v in batch.signals.items()},
        images=[batch.images[i] for i in order],
    )
    permuted = _step(Trainer(spec(student, tmp_path / "c", **{"trainer.microBatchTokens": 40}, **adam)), moved)
    (a, wa) = small
    initial = load_file(str(student / "model.safetensors"))
    moved_by = max((wa[n] - initial[n]).abs().max().item() for n in wa if n in initial)
    assert moved_by > 1e-3  # the step trained: the comparison below is not of untouched weights
    for b, wb in (large, permuted):
        assert b.loss_total == pytest.approx(a.loss_total, rel=1e-6, abs=1e-7)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
        for name in wa:
            assert torch.allclose(wa[name], wb[name], atol=1e-5, rtol=0), name


def test_a_step_trains_the_vision_tower_unless_frozen(student: Path, processor: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    initial = load_file(str(student / "model.safetensors"))
    batch, _ = mixed_batch(processor)
    trained = Trainer(spec(student, tmp_path / "a"))
    names = [m.name for m in trained.weight_metas()]
    # The HF names of the checkpoint (a tied lm_head omitted): what vLLM's and the hf engine's loaders map.
    assert set(names) == set(initial) - {"lm_head.weight"} and len(names) == len(set(names))
    assert any(n.startswith("model.visual.blocks.") for n in names) and trained.frozen_prefixes() == []
    _, weights = _step(trained, batch)
    moved = {n for n, w in weights.items() if not torch.equal(w, initial[n])}
    assert "model.visual.patch_embed.proj.weight" in moved and "model.visual.merger.linear_fc2.weight" in moved
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in moved

    frozen = Trainer(spec(student, tmp_path / "b", **{"trainer.freezeVision": True}))
    tower = frozen.model.vision_tower()
    assert tower is not None
    vision_params = {id(p) for p in tower.parameters()}
    synced = [m.name for m in frozen.weight_metas()]
    assert frozen.frozen_prefixes() == ["model.visual."]
    assert synced == [n for n in names if not n.startswith("model.visual.")]
    assert not vision_params & {id(p) for group in frozen.optimizer.param_groups for p in group["params"]}
    try:
        frozen.step(batch.to_parts())
        assert not vision_params & {id(p) for p in frozen.optimizer.state}  # no AdamW state for the tower
        after = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in frozen.model.named_parameters()
        }
        synced_after = dict(frozen.named_full_weights())
    finally:
        frozen.close()
    for name, value in after.items():
        hf = name.removeprefix("lm.")
        if hf.startswith("model.visual."):
            assert torch.equal(value, initial[hf]), f"{hf} moved though frozen"
    assert not torch.equal(
        synced_after["model.language_model.embed_tokens.weight"], initial["model.language_model.embed_tokens.weight"]
    )


def test_freeze_vision_on_a_text_student_is_refused_in_one_line(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^spec.trainer.freezeVision: the student .* has no vision tower to freeze$"):
        Trainer(make_spec(tiny_models["student"], tmp_path / "c", **{"trainer.freezeVision": True}))
    batch = make_batch(n=2)
    batch.images = [SampleImages(np.zeros((4, 8), np.float32), np.array([[1, 2, 2]], np.int64)), None]
    t = Trainer(make_spec(tiny_models["student"], tmp_path / "d"))
    try:
        with pytest.raises(ValueError, match="has image samples but the student .* is a text model"):
            t.step(batch.to_parts())
    finally:
        t.close()


@pytest.mark.parametrize("freeze", [False, True], ids=["vision-trains", "vision-frozen"])
def test_two_ranks_match_one_rank_on_a_mixed_batch(student: Path, processor: Any, tmp_path: Path, freeze: bool) -> None:
    """Rank 0 broadcasts the pixel rows with the batch; at a micro-batch index where one rank has
    images and the other none, both run the (sharded) vision tower, and the step equals one
    rank's, whether the tower trains or is frozen, with gradient checkpointing on the two ranks."""
    batch, _ = mixed_batch(processor)
    overrides = {"trainer.microBatchTokens": 8, "trainer.freezeVision": freeze}
    # The split has such an index (sample 0 is text, 1 and 2 have images, 3 is text).
    plans = plan_step([len(t) for t in batch.token_ids], 2, 8, True)
    n_micro = max(len(p) for p in plans)
    has_images = [
        [any(batch.images[i] for row in micro_batch_rows(p, j) for i in row) for p in plans] for j in range(n_micro)
    ]
    assert [True, False] in has_images or [False, True] in has_images
    assert vision_lockstep(plans, [0, 1, 2, 0], 2) == [any(h) for h in has_images]
    torch.save(batch, saved_batch_path(tmp_path / "out-saved_batch-2.pt"))
    checkpointed = spec(student, tmp_path / "c2", **overrides, **{"trainer.gradientCheckpointing": True})
    two = run_ranks(2, checkpointed.model_dump_json(by_alias=True), tmp_path, "saved_batch")
    assert two["checkpointing"]
    one_stats, one = _step(Trainer(spec(student, tmp_path / "c1", **overrides)), batch)
    assert two["stats"].loss_total == pytest.approx(one_stats.loss_total, rel=1e-6, abs=1e-7)
    assert two["stats"].grad_norm == pytest.approx(one_stats.grad_norm, rel=1e-5)
    assert list(one) == list(two["weights"])
    assert any(n.startswith("model.visual.") for n in one) != freeze
    for name, w in one.items():
        # Adam's noise on near-zero gradients, as in tests/test_trainer_dist.py (lr 1e-2 here).
        assert torch.allclose(w, two["weights"][name], atol=1e-4), name


def test_export_loads_in_transformers_with_its_processor(student: Path, processor: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    batch, inputs = mixed_batch(processor)
    trainer = Trainer(spec(student, tmp_path / "ckpt"))
    try:
        trainer.step(batch.to_parts())
        weights = dict(trainer.named_full_weights())
        out = trainer.export_hf(tmp_path / "export")
    finally:
        trainer.close()
    exported = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).eval()
    state = exported.state_dict()
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name
    loaded = AutoProcessor.from_pretrained(str(out))
    ids, again = image_prompt(loaded, [dots(96, 64, 3), dots(64, 128, 1)], "count")
    assert ids == batch.token_ids[2][: batch.prompt_lens[2]]
    assert torch.equal(again["pixel_values"], inputs[2]["pixel_values"])


def test_images_reach_the_batch_through_the_students_processor(student: Path, processor: Any) -> None:
    """Base64 PNGs of a group become each sample's pixel rows once, at buffer entry; a prompt whose
    image pad tokens do not match its images is refused in one line naming the sample; a text
    batch carries no image tensors."""
    from kubedistill.runtime.driver.batcher import BatchRequirements, assemble, prepare, to_train_batch
    from kubedistill.runtime.driver.pixels import StudentImages
    from kubedistill.runtime.driver.samples import SampleGroup

    req = BatchRequirements(
        group_size=2, mini_batch_size=4, contract=CONTRACTS[LossMode.k3], images=StudentImages(student)
    )
    images = [dots(96, 64, 3), dots(64, 128, 1)]
    prompt, out = image_prompt(processor, images, "count")

    def group(gid: int, ids: list[int], pictures: list[str] | None) -> SampleGroup:
        g = SampleGroup.for_prompt(gid, ids, 2, max_tokens=4, data_source="dots", images=pictures)
        for s in g.samples:
            s.continuation()
            s.response_ids, s.logprobs, s.versions, s.finish_reason = [30, 31], [-0.5, -0.5], [0, 0], "stop"
            s.signals["teacher_logprobs"] = [-0.1, -0.2]
        return g

    pictured = group(1, prompt, [b64_png(im) for im in images])
    prepare(pictured, req)
    made = [s.arrays.images for s in pictured.samples]
    assert made[0] is made[1] is not None  # once per group
    assert np.array_equal(made[0].pixel_values, out["pixel_values"].numpy())
    assert made[0].grid_thw.tolist() == out["image_grid_thw"].tolist()
    text = group(2, [1, 2, 3], None)
    step = assemble([pictured, text], req, trainer_version=0)
    parts = step.train_batches(req)[0]
    header = parts.header()
    assert header["images"] == [2, 2, 0, 0] and len(header["tensors"]) == 5  # ids, mu, teacher, pixels, grids
    assert to_train_batch(text.samples, req).header()["images"] is None
    assert len(to_train_batch(text.samples, req).header()["tensors"]) == 3  # a text batch: no image tensors
    back = to_lists(parts.to_tensors([2, 0, 3, 1]))  # laid out in another order: images move with samples
    assert back.images is not None and back.images[0] is None and back.images[2] is None
    assert np.array_equal(back.images[1].pixel_values, made[0].pixel_values)

    # Restored from a checkpoint (no arrays yet): made when the step is assembled.
    restored = SampleGroup.from_dict(pictured.to_dict())
    step = assemble([restored, text], req, trainer_version=0)
    assert step.train_batches(req)[0].header()["images"] == [2, 2, 0, 0]

    # A prompt of 3 image pad tokens for a 96x64 image (6 merged patches): refused, naming the sample.
    pad = processor.image_token_id
    wrong = group(4, [i for i in prompt if i != pad][:4] + [pad] * 3, [b64_png(images[0])])
    prepare(wrong, req)  # left for to_train_batch to refuse with the whole story
    assert wrong.samples[0].arrays is None
    with pytest.raises(
        ValueError, match=r"^sample 4-0 \(data_source 'dots'\): its prompt has 3 image pad tokens .* need 6"
    ):
        to_train_batch(wrong.samples, req, images={4: wrong.images or []})
