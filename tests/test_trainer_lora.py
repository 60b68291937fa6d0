"""LoRA students on the trainer (spec.trainer.lora): only PEFT's adapters train, sync, checkpoint
and resume; the export is a merged HF model or a PEFT adapter folder; across two FSDP ranks the
step equals one rank's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kubedistill.api.spec import DistillationJobSpec
from kubedistill.runtime.trainer import Trainer
from kubedistill.runtime.trainer.lora import adapted_leaf_names, wire_name
from trainer_cases import make_batch, make_parts, make_spec, run_ranks

torch.set_num_threads(1)

LORA = {"rank": 4, "alpha": 8.0, "targetModules": ["q_proj", "v_proj", "down_proj"]}


def lora_spec(student: Path, ckpt: Path, **lora: object) -> DistillationJobSpec:
    return make_spec(student, ckpt, **{"trainer.lora": {**LORA, **lora}, "trainer.optim.lr": 1e-2})


@pytest.fixture
def trainer(tiny_models: dict[str, Path], tmp_path: Path):
    t = Trainer(lora_spec(tiny_models["student"], tmp_path / "ckpt"))
    yield t
    t.close()


def _base_weights(student: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(student / "model.safetensors"))


def _hf_logprobs(model: object, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, :-1].float()  # type: ignore[operator]
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0]


def _trainer_logprobs(trainer: Trainer, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    with torch.no_grad():
        lp, _ = trainer.model(x, torch.arange(len(ids) - 1), x[0, 1:], None)
    return lp


def test_only_adapters_train_and_sync(trainer: Trainer, tiny_models: dict[str, Path]) -> None:
    base = _base_weights(tiny_models["student"])
    metas = trainer.weight_metas()
    names = [m.name for m in metas]
    # Two layers x three target modules x (A, B), under PEFT's saved names.
    assert len(names) == 12 and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in names)
    assert "model.layers.1.mlp.down_proj.lora_B.weight" in names
    adapter = trainer.lora_adapter()
    assert adapter is not None and adapter.rank == 4 and adapter.scale == pytest.approx(2.0)
    assert adapter.target_modules == ["down_proj", "q_proj", "v_proj"] == adapted_leaf_names(names)
    before = {n: t.clone() for n, t in trainer.named_full_weights()}
    assert all(torch.count_nonzero(t) == 0 for n, t in before.items() if "lora_B" in n)  # PEFT's init

    stats = trainer.step(make_parts())
    assert stats.grad_norm > 0
    after = dict(trainer.named_full_weights())
    assert [m.shape for m in metas] == [list(t.shape) for t in after.values()]
    assert all(not torch.equal(after[n], before[n]) for n in names if "lora_B" in n)
    # The frozen base is untouched.
    for name, p in trainer.model.named_parameters():
        if not p.requires_grad and name.endswith(".base_layer.weight"):
            hf = name.removeprefix("lm.base_model.model.").replace(".base_layer", "")
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # sharded only with mixed precision
            assert torch.equal(full.detach(), base[hf]), name
    assert sum(p.numel() for p in trainer.trainable) == sum(t.numel() for t in after.values())


def test_bad_target_module_is_one_clear_line(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError) as e:
        Trainer(lora_spec(tiny_models["student"], tmp_path / "ckpt", targetModules=["q_proj", "qkv"]))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("spec.trainer.lora.targetModules: qkv not in Qwen2ForCausalLM")
    assert "q_proj" in message and "down_proj" in message


def test_checkpoint_holds_adapters_only_and_resume_replays(trainer: Trainer, tiny_models: dict[str, Path]) -> None:
    trainer.step(make_parts())
    path = trainer.save_checkpoint(1, 3, {"cursor": 5})
    state = torch.load(path / "trainer.pt", weights_only=False)
    assert {wire_name(k) for k in state["model"]} == {m.name for m in trainer.weight_metas()}
    assert len(state["optimizer"]["state"]) == len(trainer.trainable)

    trainer.step(make_parts(seed=2))
    two = {n: t.clone() for n, t in trainer.named_full_weights()}
    resumed = trainer.resume()
    assert resumed is not None and (resumed.step, resumed.weight_version, resumed.driver_state) == (1, 3, {"cursor": 5})
    trainer.step(make_parts(seed=2))
    for name, t in trainer.named_full_weights():
        assert torch.allclose(t, two[name], atol=1e-7), name


def test_a_full_weight_checkpoint_does_not_resume_a_lora_job(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    full = Trainer(make_spec(tiny_models["student"], tmp_path / "ckpt"))
    try:
        full.save_checkpoint(1, 1, None)
    finally:
        full.close()
    lora = Trainer(lora_spec(tiny_models["student"], tmp_path / "ckpt"))
    try:
        with pytest.raises(ValueError, match=r"^spec.trainer.lora: the newest checkpoint .* holds full weights"):
            lora.resume()
    finally:
        lora.close()


def test_merged_export_loads_in_transformers_with_the_trainers_log_probs(
    trainer: Trainer, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    trainer.step(make_parts())
    ids = make_batch(seed=3).token_ids[0]
    out = trainer.export_hf(tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert not any("lora" in n for n in merged.state_dict())
    assert torch.allclose(_hf_logprobs(merged, ids), _trainer_logprobs(trainer, ids), atol=1e-5)
    # The adapters moved the model away from its base.
    base = AutoModelForCausalLM.from_pretrained(str(tiny_models["student"]), dtype=torch.float32)
    assert not torch.allclose(_hf_logprobs(base, ids), _hf_logprobs(merged, ids), atol=1e-4)


def test_adapter_export_is_a_peft_folder_naming_its_base(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t = Trainer(lora_spec(tiny_models["student"], tmp_path / "ckpt", export="adapter"))
    try:
        t.step(make_parts())
        ids = make_batch(seed=3).token_ids[0]
        out = t.export_hf(tmp_path / "adapter")
        want = _trainer_logprobs(t, ids)
    finally:
        t.close()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {f.name for f in out.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(str(tiny_models["student"]), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(out))
    assert loaded.peft_config["default"].base_model_name_or_path == str(tiny_models["student"].resolve())
    assert torch.allclose(_hf_logprobs(loaded, ids), want, atol=1e-5)


def test_two_ranks_match_one_rank(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """FSDP2 shards the PEFT model like any other: the same adapters, the same step, with gradient
    checkpointing on the two ranks (PEFT's frozen embedding then needs inputs that require grad)."""
    spec = lora_spec(tiny_models["student"], tmp_path / "ckpt")
    spec.trainer.gradient_checkpointing = True
    two = run_ranks(2, spec.model_dump_json(by_alias=True), tmp_path, "step_resume")
    assert two["checkpointing"]
    reference = Trainer(lora_spec(tiny_models["student"], tmp_path / "ckpt-1"))
    try:
        s1 = reference.step(make_parts())
        one = {n: t.clone() for n, t in reference.named_full_weights()}
    finally:
        reference.close()
    assert abs(s1.loss_total - two["stats"].loss_total) < 1e-6
    assert list(one) == list(two["weights"])
    for name, w in one.items():
        assert torch.allclose(w, two["weights"][name], atol=1e-5), name
    assert two["resumed"] == (1, 7, {"cursor": 11}, 1)
    for name, w in two["after_two"].items():
        assert torch.allclose(w, two["replayed"][name], atol=1e-6), name
