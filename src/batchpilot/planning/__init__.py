"""The arithmetic everything else trusts: batch sizes, ramp-up, node scheduling, learning rate, cost.

Pure Python: this package must not import torch, kfp or any cloud client.
"""

from batchpilot.planning.batch import (
    global_batch_to_load,
    gradient_accumulation_steps,
    num_loading_hosts,
)
from batchpilot.planning.cost import CostEstimate, estimate_cost
from batchpilot.planning.lr import LRSchedule
from batchpilot.planning.nodes import data_parallel_size, schedule_nodes
from batchpilot.planning.rampup import (
    BatchSchedule,
    constant_schedule,
    explicit_schedule,
    maxtext_rampup,
    megatron_rampup,
)
from batchpilot.planning.stages import Plan, Stage, plan_stages

__all__ = [
    "BatchSchedule",
    "CostEstimate",
    "LRSchedule",
    "Plan",
    "Stage",
    "constant_schedule",
    "data_parallel_size",
    "estimate_cost",
    "explicit_schedule",
    "global_batch_to_load",
    "gradient_accumulation_steps",
    "maxtext_rampup",
    "megatron_rampup",
    "num_loading_hosts",
    "plan_stages",
    "schedule_nodes",
]
