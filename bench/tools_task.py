"""The tool-use task of the learning benchmark (`bench/learning.py --task tools`): products of a
three-digit and a two-digit number (`347*28=`), too long for a tiny model to work out in its head,
with the calculator environment (examples/environments/calculator) as the tool.

A full tool trace, as the driver builds it (runtime/driver/episodes.py):

    prompt       <bos>347*28=
    turn 1       <calc>347*28</calc><eos>        the student's; the action of the episode's step
    observation  {"result":"9716"}               the environment's (observationKey unset: the
                                                 observation's JSON without done/reward/metadata,
                                                 `{"result": "9716"}`), rendered by the student's
                                                 chat template, which for these char-level models
                                                 is plain concatenation: the text as is, less the
                                                 space (below)
    turn 2       9716<eos>                       a turn with no call: the episode is done

The JSON's braces delimit the number: with the bare `result` the student could not tell where
the observation ends and its own copy begins (`<eos>97169` is `9716` + `9` or a five-digit
result). A direct answer is one turn, `9716<eos>`. The reward (built in, data_source
`synthetic/calc`: exact match) scores the final turn.

Everything is tokenized with the tokenizer as the runtime loads it (AutoTokenizer on the saved
folder): transformers 5 loads a qwen2 model's folder with Qwen2Tokenizer, whose byte-level
pre-tokenizer drops the characters the char-level vocabulary lacks in byte-level form, the space
among them. Trained with the tokenizer `char_tokenizer` returns (which keeps the space), the
models would learn traces the driver never builds.

Models (char-level, built here like the quickstart's, kubedistill/demo/quickstart.py; cached
under .kubedistill/bench/tools):
* teacher: the quickstart's teacher shape, trained only on full tool traces, with the loss on
  the two turns (prompt and observation masked);
* student: the quickstart's student shape, warm-started on a mix of mostly direct answers (which
  it cannot compute) and a small share of tool traces: it has the format, not the habit. Greedy,
  it answers directly.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import REPO

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kubedistill.demo import quickstart
from kubedistill.demo.quickstart import Supervised

DATA_SOURCE = "synthetic/calc"
"""Rows' data_source: the built-in exact-match reward (runtime/driver/rewards.py, `synthetic/*`)."""
OBSERVATION_KEY = "result"
"""The calculator's observation field (the student reads the observation's JSON, key included)."""
ALPHABET = '0123456789*=<>/calc{}":resut'
"""Prompts, calls, results and the observation's JSON, less the space the runtime's tokenizer
drops: 27 distinct characters."""
TOOL_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
"""The calculator's own pattern (examples/environments/calculator/server.py)."""
PRODUCT = re.compile(r"(\d+)\*(\d+)")
TURN_TOKENS = 24
"""One turn's budget (sampling.maxTokens): `<calc>999*99</calc>` + <eos> is 20 tokens."""
MAX_TURNS = 3
TRACE_TOKENS = 64
"""A whole trace's budget (multiTurn.maxTraceTokens): a full tool trace is 20 + 17-18 + 5-6 tokens."""
HELD_OUT = 1000
CALC_SERVER = REPO / "examples/environments/calculator"
OPENENV_PYTHON = REPO / ".venv/openenv-core-0.3.0/bin/python"
"""examples/environments/install-openenv.sh's venv for OpenEnv servers."""

TEACHER = quickstart.TEACHER
STUDENT = quickstart.STUDENT
TEACHER_TRAINING = Supervised(steps=400, lr=2e-3, warmup=50, decay=True, betas=(0.9, 0.98), seed=0, batch_size=64)
STUDENT_WARM_START = Supervised(steps=1000, lr=1e-3, warmup=50, decay=False, betas=(0.9, 0.999), seed=1, batch_size=64)
"""Constant LR, as the quickstart's warm start (a student at the end of a decayed schedule loses
its annealing gain as soon as OPD moves it)."""
STUDENT_TOOL_SHARE = 0.2
"""Share of the warm start's examples that are full tool traces (the rest: direct answers)."""
MARKER = "prepared.json"


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}*{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a * self.b)

    @property
    def call(self) -> str:
        return f"<calc>{self.a}*{self.b}</calc>"


def split(seed: int = 0, held_out: int = HELD_OUT) -> tuple[list[Problem], list[Problem]]:
    """All 81,000 problems (100-999 times 10-99), shuffled; the last `held_out` never trained on."""
    problems = [Problem(a, b) for a in range(100, 1000) for b in range(10, 100)]
    random.Random(seed).shuffle(problems)
    return problems[:-held_out], problems[-held_out:]


def verl_row(p: Problem, index: int) -> dict[str, Any]:
    """The quickstart's row (kubedistill/demo/arith.py) with this task's data_source."""
    from kubedistill.demo import arith

    return {**arith.verl_row(p, index), "data_source": DATA_SOURCE, "ability": "tool use"}  # type: ignore[arg-type]


def write_jsonl(problems: Iterable[Problem], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(verl_row(p, i)) + "\n" for i, p in enumerate(problems)))
    return path


def calculator(message: str) -> tuple[str, bool]:
    """The calculator environment's step, in process, for the products of this task: (the
    observation's text as the driver renders it, done). A call that is not `<digits>*<digits>`
    gets an error line (the server's parser says more)."""
    from kubedistill.runtime.environments.client import render_observation

    calls = TOOL_CALL.findall(message)
    if not calls:
        return "", True
    lines = []
    for c in calls:
        m = PRODUCT.fullmatch(c)
        lines.append(str(int(m.group(1)) * int(m.group(2))) if m else "error")
    return render_observation({OBSERVATION_KEY: "\n".join(lines)}, None), False


def runtime_tokenizer(out_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `out_dir` loaded as the driver loads it (AutoTokenizer: the folder's
    config.json decides the class, so the model is saved first), checked to give back every piece
    of a trace."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out_dir))
    p = Problem(347, 28)
    observation, _ = calculator(p.call)
    for text in (p.prompt, p.call, p.answer, observation.replace(" ", "")):
        ids = tok(text, add_special_tokens=False).input_ids
        if tok.decode(ids) != text or tok.unk_token_id in ids:
            raise RuntimeError(
                f"{out_dir}: the tokenizer does not give back {text!r}: {tok.convert_ids_to_tokens(ids)}"
            )
    return tok


def renderer(tok: PreTrainedTokenizerBase):
    """The driver's own observation renderer for this tokenizer (observationRole tool)."""
    from kubedistill.runtime.driver.episodes import ObservationRenderer

    return ObservationRenderer(tok, "tool", tok.eos_token)


def trace_pieces(tok: PreTrainedTokenizerBase, p: Problem, tool: bool) -> list[tuple[list[int], bool]]:
    """(token ids, trained on) pieces of an example: the prompt, then the tool trace's turns and
    observation, or the direct answer."""

    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False).input_ids)

    pieces = [(ids(tok.bos_token + p.prompt), False)]
    if tool:
        observation, _ = calculator(p.call)
        pieces += [(ids(p.call) + [tok.eos_token_id], True), (renderer(tok).render(observation, True), False)]
    pieces.append((ids(p.answer) + [tok.eos_token_id], True))
    return pieces


def encode(tok: PreTrainedTokenizerBase, examples: list[tuple[Problem, bool]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) for supervised training: the loss on the student's turns only."""
    import torch

    seqs, labels = [], []
    for p, tool in examples:
        pieces = trace_pieces(tok, p, tool)
        seqs.append([t for ids, _ in pieces for t in ids])
        labels.append([t if train else -100 for ids, train in pieces for t in ids])
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    lab = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
    return ids, lab


def greedy_traces(
    model: PreTrainedModel, tok: PreTrainedTokenizerBase, problems: list[Problem], *, force_tool: bool = False
) -> list[dict[str, Any]]:
    """Greedy traces against the in-process calculator, as the job's held-out evaluation runs
    them: {'turns', 'final', 'tool'} per problem. `force_tool`: turn 1 starts with `<` (what the
    student does once it has the habit)."""
    import torch

    render = renderer(tok)
    prefix = list(tok("<", add_special_tokens=False).input_ids) if force_tool else []
    seqs = [list(tok(tok.bos_token + p.prompt, add_special_tokens=False).input_ids) + prefix for p in problems]
    prompt_len = [len(s) - len(prefix) for s in seqs]
    starts = list(prompt_len)
    out: list[dict[str, Any]] = [{"turns": 0, "final": "", "tool": False} for _ in problems]
    active = list(range(len(problems)))
    for _turn in range(MAX_TURNS):
        by_len: dict[int, list[int]] = {}
        for i in active:
            by_len.setdefault(len(seqs[i]), []).append(i)
        still = []
        for group in by_len.values():
            for j in range(0, len(group), 500):
                chunk = group[j : j + 500]
                ids = torch.tensor([seqs[i] for i in chunk])
                with torch.no_grad():
                    gen = model.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=TURN_TOKENS - (len(prefix) if _turn == 0 else 0),
                        do_sample=False,
                        eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id,
                    )
                for i, g in zip(chunk, gen.tolist()):
                    new = g[ids.shape[1] :]
                    if tok.eos_token_id in new:
                        new = new[: new.index(tok.eos_token_id) + 1]
                    seqs[i] += new
                    turn = tok.decode(seqs[i][starts[i] :], skip_special_tokens=True)
                    out[i]["turns"] += 1
                    out[i]["final"] = turn
                    out[i]["tool"] |= bool(TOOL_CALL.search(turn))
                    observation, done = calculator(turn)
                    if done:
                        continue
                    obs = render.render(observation, new[-1:] == [tok.eos_token_id])
                    if len(seqs[i]) + len(obs) - prompt_len[i] >= TRACE_TOKENS:  # no room for another turn
                        continue
                    seqs[i] += obs
                    starts[i] = len(seqs[i])
                    still.append(i)
        active = still
        if not active:
            break
    return out


def scores(model: PreTrainedModel, tok: PreTrainedTokenizerBase, problems: list[Problem]) -> dict[str, float]:
    """Greedy held-out accuracy, the share of traces that call the tool, and the accuracy of the
    tool path (turn 1 forced to start a call)."""
    free = greedy_traces(model, tok, problems)
    forced = greedy_traces(model, tok, problems, force_tool=True)
    n = len(problems)
    return {
        "accuracy": sum(t["final"].strip() == p.answer for t, p in zip(free, problems)) / n,
        "toolShare": sum(t["tool"] for t in free) / n,
        "toolPathAccuracy": sum(t["final"].strip() == p.answer for t, p in zip(forced, problems)) / n,
    }


def train(
    name: str,
    shape: quickstart.ModelShape,
    cfg: Supervised,
    tok: PreTrainedTokenizerBase,
    tool_share: float,
    *,
    log: Callable[[str], object] = print,
    every: int = 100,
) -> PreTrainedModel:
    """A model of `shape` trained with `cfg` (kubedistill/demo/sft.py's loop) on a `tool_share`
    of tool traces and direct answers for the rest."""
    import torch
    from transformers import AutoModelForCausalLM

    from kubedistill.demo.sft import train_loop
    from kubedistill.demo.tiny import tiny_config

    train_set, held_out = split()
    probe = held_out[:200]
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(tiny_config(len(tok), **shape))
    t0 = time.time()

    def next_batch() -> dict[str, Any]:
        examples = [(p, rng.random() < tool_share) for p in rng.sample(train_set, cfg.batch_size)]
        ids, labels = encode(tok, examples)
        return {"input_ids": ids, "labels": labels}

    def on_step(step: int, loss: float) -> None:
        if step % every == 0 and step < cfg.steps:
            model.eval()
            s = scores(model, tok, probe)
            model.train()
            log(
                f"tools: {name} step {step}/{cfg.steps}, loss {loss:.3f}, accuracy {s['accuracy']:.1%}, "
                f"tool share {s['toolShare']:.1%}, tool path {s['toolPathAccuracy']:.1%} ({time.time() - t0:.0f} s)"
            )

    train_loop(
        model, next_batch, cfg.steps, lr=cfg.lr, warmup=cfg.warmup, decay=cfg.decay, betas=cfg.betas, on_step=on_step
    )
    return model


def prepare_tools(base: Path, *, problems: int = 500, log: Callable[[str], object] = print) -> dict[str, Any]:
    """Make `base`/{teacher,student,student-init,data} (reused when `base`/prepared.json records the
    same schedules); returns prepared.json: per model its schedule, seconds and held-out scores."""
    import tempfile

    import torch

    from kubedistill.demo.tiny import build_tiny_model, char_tokenizer

    base = Path(base)
    marker = base / MARKER
    common = {"alphabet": ALPHABET, "tokenizer": "as the runtime loads it"}
    wanted = {
        "teacher": {**quickstart.schedule_json(TEACHER_TRAINING), "toolShare": 1.0, "shape": dict(TEACHER), **common},
        "student": {
            **quickstart.schedule_json(STUDENT_WARM_START),
            "toolShare": STUDENT_TOOL_SHARE,
            "shape": dict(STUDENT),
            **common,
        },
    }
    info: dict[str, Any] = json.loads(marker.read_text()) if marker.is_file() else {}
    stale = [n for n, w in wanted.items() if info.get(n, {}).get("schedule") != w]
    if stale:
        quickstart.use_all_cores(torch)
        char = char_tokenizer(ALPHABET)
        with tempfile.TemporaryDirectory(prefix="kd-tools-tok-") as tmp:
            tok = runtime_tokenizer(build_tiny_model(Path(tmp), char))
        held_out = split()[1][:problems]
        for name in stale:
            t0 = time.time()
            cfg = TEACHER_TRAINING if name == "teacher" else STUDENT_WARM_START
            shape = TEACHER if name == "teacher" else STUDENT
            model = train(name, shape, cfg, tok, wanted[name]["toolShare"], log=log)
            model.save_pretrained(str(base / name), safe_serialization=True)
            char.save_pretrained(str(base / name))
            if name == "student":  # the untouched warm start (a job's checkpoints are elsewhere)
                shutil.copytree(base / name, base / "student-init", dirs_exist_ok=True)
            info[name] = {
                "schedule": wanted[name],
                "seconds": round(time.time() - t0, 1),
                **scores(model, tok, held_out),
            }
            s = info[name]
            log(
                f"tools: {name} trained {cfg.steps} steps in {s['seconds']} s: held-out accuracy {s['accuracy']:.1%}, "
                f"tool share {s['toolShare']:.1%}, tool path {s['toolPathAccuracy']:.1%}"
            )
    train_set, held_out = split()
    if stale or not (base / "data/val.jsonl").is_file():
        write_jsonl(train_set, base / "data/train.jsonl")
        write_jsonl(held_out, base / "data/val.jsonl")
    marker.write_text(json.dumps(info, indent=2))
    return info


def evaluate_dir(model_dir: Path, problems: int = 500) -> dict[str, float]:
    """`scores` of a saved model on the first `problems` held-out problems."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quickstart.use_all_cores(torch)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    return scores(model, tok, split()[1][:problems])


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="build the tool task's models and data")
    ap.add_argument("--cache", default=str(REPO / ".kubedistill/bench/tools"))
    print(json.dumps(prepare_tools(Path(ap.parse_args().cache)), indent=2))
