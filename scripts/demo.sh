#!/usr/bin/env bash
# The main job on a fresh machine: set up, prepare the demo token shards (once), then run the whole
# pipeline locally (canary -> explore -> plan -> ramp-up stages -> final -> report) into a new runs/demo/run-* folder.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -f runs/demo/data/manifest.json ]; then
  .venv/bin/batchpilot data prepare --demo --out file://runs/demo/data
fi
# DEMO_CONFIG=configs/demo_adaptive.yaml runs the adaptive ramp-up demo instead (stages decided at run time).
config=${DEMO_CONFIG:-configs/demo.yaml}
name=$(basename "$config" .yaml)
exec .venv/bin/batchpilot run --local --config "$config" --out "runs/$name/run-$(date +%Y%m%d-%H%M%S)" "$@"
