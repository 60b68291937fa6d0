#!/usr/bin/env bash
# The README's main command: install, then run the CPU quickstart job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/kubedistill validate examples/*.yaml
.venv/bin/kubedistill crd > /dev/null
echo "The CRD is crds/kubedistill.io_distillationjobs.yaml (kubectl apply -f crds/)."
