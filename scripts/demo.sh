#!/usr/bin/env bash
# The main job on a fresh machine: set up, prepare the demo token shards (once), then run the whole
# pipeline locally (explore -> plan -> ramp-up stages -> final -> report) into a new runs/demo/run-* folder.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -f runs/demo/data/manifest.json ]; then
  .venv/bin/batchpilot data prepare --demo --out file://runs/demo/data
fi
exec .venv/bin/batchpilot run --local --config configs/demo.yaml --output "runs/demo/run-$(date +%Y%m%d-%H%M%S)" "$@"
