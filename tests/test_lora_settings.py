"""spec.trainer.lora's rank, alpha and dropout make the PEFT adapters the trainer trains."""

from __future__ import annotations

from kubedistill.api.spec import LoraSpec
from kubedistill.runtime.trainer.lora import lora_config


def test_rank_alpha_and_dropout_make_the_peft_config() -> None:
    config = lora_config(LoraSpec(rank=4, alpha=32, dropout=0.1), ["q_proj", "v_proj"])
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 32, 0.1)
    assert set(config.target_modules) == {"q_proj", "v_proj"}
    default = lora_config(LoraSpec(), "all-linear")
    assert (default.r, default.lora_alpha, default.lora_dropout) == (8, 16, 0.0)
