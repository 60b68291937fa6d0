"""Hostile and careless manifests: `kubedistill validate` and `render` answer each with one line
naming the file, exit 1, and stay within a bounded time and memory (they read YAML through
kubedistill.api.kubeyaml's size, depth and alias limits before building anything)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = (ROOT / "examples" / "one-gpu.yaml").read_text()


def _laughs() -> str:
    """Nine levels of aliases, each ten of the one below: 10^9 values once expanded."""
    lines = ["  affinity:", "    a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    lines.append("    boom: *a8")
    return EXAMPLE + "\n".join(lines) + "\n"


CASES = {
    "not-utf8": (bytes(range(256)) * 16, "not UTF-8 text (byte 0x80 at offset 128)"),
    "billion-laughs": (_laughs().encode(), "more than 100000 values once aliases are expanded"),
    # libyaml itself stops flow nesting at 1000 levels; block nesting stops at our 64.
    "deep-flow-nesting": (b"a: " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "exceeded maximum nesting depth"),
    "deep-block-nesting": ("".join(f"{'  ' * i}k:\n" for i in range(100)).encode(), "nested more than 64 levels deep"),
    "too-large": (EXAMPLE.encode() + b"#" + b"x" * (4 << 20) + b"\n", "a manifest may be at most 3145728 bytes"),
}


def _cli(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "kubedistill.cli", *args], capture_output=True, text=True, timeout=60)
    return r, time.monotonic() - start


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["validate", "render"])
def test_hostile_manifest_gets_one_line(tmp_path: Path, case: str, command: str) -> None:
    data, expected = CASES[case]
    path = tmp_path / f"{case}.yaml"
    path.write_bytes(data)
    r, seconds = _cli(command, str(path))
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 1, out
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    assert out.startswith(f"{path}: ") and expected in out, out
    # The CLI's own start-up (pydantic, the API models) is most of it; read without bounds,
    # these inputs take minutes or run out of memory.
    assert seconds < 10, seconds


def test_a_manifest_within_the_limits_still_renders(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(EXAMPLE + "  affinity:\n    nodeAffinity: &na {}\n  tolerations: [{key: a, operator: Exists}]\n")
    r, _ = _cli("render", str(path))
    assert r.returncode == 0, r.stderr
    assert "kind: Pod" in r.stdout


@pytest.mark.parametrize(
    "args, expected",
    [
        (["rollout", "--config", "{dir}"], "--config {dir}: not a file"),
        (["rollout", "--replica", "-5", "--config", "{dir}"], "argument --replica: -5 is negative"),
        (["teacher", "--config", "{dir}/missing.json"], "--config {dir}/missing.json: no such file"),
    ],
)
def test_role_command_refuses_bad_arguments_in_one_line(tmp_path: Path, args: list[str], expected: str) -> None:
    r, _ = _cli("role", *(a.format(dir=tmp_path) for a in args))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert expected.format(dir=tmp_path) in r.stderr.strip().splitlines()[-1]


def test_version_and_help_say_what_the_tool_is() -> None:
    from kubedistill import __version__

    version = subprocess.run([sys.executable, "-m", "kubedistill.cli", "--version"], capture_output=True, text=True)
    assert (version.returncode, version.stdout.strip()) == (0, f"kubedistill {__version__}")
    help_text = subprocess.run([sys.executable, "-m", "kubedistill.cli", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0
    description = help_text.stdout.split("\n\n")[1]
    assert description.startswith("Distill a student LLM"), description
    assert "lazily" not in help_text.stdout
    assert "kubedistill validate JOB.yaml" in help_text.stdout
