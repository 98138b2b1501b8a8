"""The rehearsal's config: the user's cluster, a small pool, a tiny paced model, a prefix of its own.

Pure: no torch, kfp or cloud client. Two stages on two node counts (1, then 2) so that a launch, a stage
change and a resize each happen; every optimizer step paced (`train.min_step_s`) so the first stage lasts
long enough to delete a trainer pod after its first checkpoint and the final one long enough to delete the
train task's pod and see Argo's retry (its backoff) adopt the running JobSet, on a CPU pool or a GPU alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

PREFIX = "batchpilot-rehearsals"
"""Under the bucket of `train.checkpoint_uri`: one folder per rehearsal (data, checkpoints), deleted after."""
FIRST_STAGE_STEPS = 60
"""Paced steps of the first stage: a checkpoint every few seconds, a trainer pod deleted after the first."""
FINAL_MARGIN_S = 180.0
"""The final stage outlasts the train task's retry backoff by this much: a new task pod to start and adopt."""
CHECKPOINT_EVERY_S = 5.0
TINY_MODEL = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 257}


@dataclass(frozen=True)
class Target:
    """The pool the rehearsal runs on, as the Container API describes it."""

    pool: str
    machine_type: str
    accelerator_type: str | None
    devices_per_node: int
    idle_nodes: int
    """The pool's size before the rehearsal: what its exit handler scales it back to."""


def rehearsal_root(checkpoint_uri: str, rehearsal_id: str) -> str:
    """`gs://BUCKET/batchpilot-rehearsals/ID`: the bucket the run's checkpoints go to, a folder of its own."""
    if not checkpoint_uri.startswith("gs://"):
        raise ValueError(f"train.checkpoint_uri {checkpoint_uri!r} is no gs:// URI")
    bucket = checkpoint_uri.removeprefix("gs://").split("/", 1)[0]
    return f"gs://{bucket}/{PREFIX}/{rehearsal_id}"


def final_stage_steps(*, pace_s: float, retry_backoff_s: float) -> int:
    """Paced steps of the final stage: the train task's retry comes `retry_backoff_s` after its pod is lost."""
    return math.ceil((retry_backoff_s + FINAL_MARGIN_S) / pace_s)


def rehearsal_config(
    user: dict[str, Any], *, target: Target, rehearsal_id: str, pace_s: float, retry_backoff_s: float
) -> dict[str, Any]:
    """The rehearsal's config from the user's (as JSON): same cluster, namespace, image and provisioning;
    `target`'s pool; stage 0 on one node, the final stage on two; nothing shared with the user's runs."""
    root = rehearsal_root(user["train"]["checkpoint_uri"], rehearsal_id)
    per_node = target.devices_per_node
    first_samples = FIRST_STAGE_STEPS * per_node  # one sample per device and step
    final_samples = final_stage_steps(pace_s=pace_s, retry_backoff_s=retry_backoff_s) * 2 * per_node
    cluster = {
        **user["cluster"],
        "node_pool": target.pool,
        "machine_type": target.machine_type,
        "accelerator_type": target.accelerator_type,
        "devices_per_node": per_node,
        "max_nodes": 2,
        "min_nodes": 1,
        "idle_nodes": target.idle_nodes,
        "cpu_per_node": None,
        "memory_per_node_bytes": None,
        "device_memory_bytes": None,
        "device_peak_flops": None,
        "gpudirect_networks": None,
        "fewer_nodes": "fail",
        "tpu_zone": None,
    }
    return {
        "name": f"rehearse-{rehearsal_id}",
        "model": {"args": dict(TINY_MODEL)},
        "data": {"uri": f"{root}/data", "seq_len": 32},
        "cluster": cluster,
        "batch": {
            "global_batch_size": 2 * per_node,
            "micro_batch_size": 1,
            "schedule": f"0:{per_node} {first_samples}:{2 * per_node}",
        },
        "train": {
            "total_samples": first_samples + final_samples,
            "lr": 1.0e-3,
            "warmup_samples": 4 * per_node,
            "checkpoint_uri": f"{root}/ckpt",
            "checkpoint_every_s": CHECKPOINT_EVERY_S,
            "min_step_s": pace_s,
            "eval_samples": 0,
            "measure_noise_scale": False,
        },
        "explore": {"study": False},
    }
