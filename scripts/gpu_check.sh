#!/usr/bin/env bash
# The trainer and explore on one CUDA GPU (needs a CUDA build of torch; CI has no GPU and never runs it):
#   1. bf16 training (train.precision auto -> bf16 autocast on CUDA) of a GPT-2-small-sized model
#      through a two-stage ramp-up, with a resume between the stages;
#   2. the CUDA out-of-memory path: a micro batch far too large for the device is halved until it fits,
#      keeping the global batch;
#   3. explore on the GPU: probes measure device memory and time, an out-of-memory probe is recorded.
# Usage: bash scripts/gpu_check.sh [WORK_DIR] ; with the package not installed, src/ goes on PYTHONPATH.
# Results go to WORK_DIR (default /tmp/batchpilot-gpu); docs/status.md records what it measured.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
work=${1:-/tmp/batchpilot-gpu}
py=${PYTHON:-python3}
rm -rf "$work" && mkdir -p "$work"
"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('device', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
"$py" -m batchpilot data prepare --demo --out "file://$work/data" --no-progress

model='{n_layer: 12, n_head: 12, n_embd: 768, block_size: 1024, vocab_size: 257}'
write_config() {  # name global_batch micro_batch ramp_samples total_samples
  cat > "$work/$1.yaml" <<EOF
name: $1
model: {args: $model}
data: {uri: "file://$work/data", seq_len: 1024}
cluster: {devices_per_node: 1, max_nodes: 1}
batch: {global_batch_size: $2, micro_batch_size: $3, rampup: {start: $(($2 / 2)), increment: $(($2 / 2)), samples: $4}}
train: {total_samples: $5, lr: 6.0e-4, warmup_samples: $2, checkpoint_uri: "file://$work/$1-ckpt", precision: auto}
explore: {max_probes: 7, activation_checkpointing: [false, true], study_train_steps: 5}
EOF
  "$py" -m batchpilot plan --config "$work/$1.yaml" --out "$work/$1-plan.json" --force
}
train() {  # name stage
  "$py" -m torch.distributed.run --standalone --nproc_per_node 1 -m batchpilot train \
    --plan "$work/$1-plan.json" --stage "$2" --out "$work/$1"
}

echo "== 1. bf16 training, two stages with a resume between them"
write_config bf16 32 16 256 1536
train bf16 0
train bf16 final
echo "== 2. CUDA out of memory: micro batch 512 x 1024 tokens, halved until it fits"
write_config oom 1024 512 1024 3072
train oom all 2>&1 | tee "$work/oom.log"
grep -q "out of memory at micro_batch_size=512" "$work/oom.log"
echo "== 3. explore on the GPU"
"$py" -m batchpilot explore --config "$work/bf16.yaml" --out "$work/explore" --max-probes 7
