"""The arithmetic everything else trusts: batch sizes, ramp-up, node scheduling, learning rate, cost.

Pure Python: this package must not import torch, kfp or any cloud client.
"""

from batchpilot.planning.batch import (
    Problems,
    global_batch_to_load,
    gradient_accumulation_steps,
    num_loading_hosts,
)
from batchpilot.planning.cost import CostEstimate, estimate_cost
from batchpilot.planning.lr import LRSchedule
from batchpilot.planning.nodes import (
    Placement,
    data_parallel_size,
    node_counts,
    schedule_nodes,
    unschedulable_stages,
)
from batchpilot.planning.rampup import (
    BatchSchedule,
    constant_schedule,
    explicit_schedule,
    maxtext_rampup,
    megatron_rampup,
    nearest_ramp,
    seesaw_rampup,
)
from batchpilot.planning.stages import MAX_STAGES, Plan, Stage, plan_stages

__all__ = [
    "MAX_STAGES",
    "BatchSchedule",
    "CostEstimate",
    "LRSchedule",
    "Placement",
    "Plan",
    "Problems",
    "Stage",
    "constant_schedule",
    "data_parallel_size",
    "estimate_cost",
    "explicit_schedule",
    "global_batch_to_load",
    "gradient_accumulation_steps",
    "maxtext_rampup",
    "megatron_rampup",
    "nearest_ramp",
    "node_counts",
    "num_loading_hosts",
    "plan_stages",
    "schedule_nodes",
    "seesaw_rampup",
    "unschedulable_stages",
]
