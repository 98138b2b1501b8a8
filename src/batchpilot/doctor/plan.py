"""The plan's largest launch, and what a local run needs of this machine."""

from __future__ import annotations

from batchpilot.doctor.core import Check, Context, Largest, fail, nodes_text, ok, skip


def check_plan(context: Context) -> Check:
    """The largest launch, from the planner without exploring (cluster.max_nodes when the micro batch or
    the target is decided at run time)."""
    from batchpilot.plan.stages import build_plan
    from batchpilot.planning.launches import launches

    config = context.config
    devices = config.cluster.devices_per_node
    undecided = [
        f"batch.{name} is {value}"
        for name, value in (
            ("micro_batch_size", config.batch.micro_batch_size),
            ("global_batch_size", config.batch.global_batch_size),
        )
        if value in ("explore", "auto")
    ]
    if undecided:
        largest = Largest(config.cluster.max_nodes, devices)
        how = f"{' and '.join(undecided)}: taken at cluster.max_nodes, the most the config allows"
        return ok("plan", f"largest launch {nodes_text(largest)} ({how})", found=largest)
    micro = config.batch.micro_batch_size
    assert isinstance(micro, int)
    plan = build_plan(config, micro_batch_size=micro)
    biggest = max(launches(plan), key=lambda launch: launch.requested_nodes)
    largest = Largest(biggest.requested_nodes, devices)
    return ok(
        "plan", f"largest launch {biggest.name}: {nodes_text(largest)} (micro batch {micro})", found=largest
    )


def skip_cloud(context: Context) -> Check:
    return skip(
        "cloud", "backend local: credentials, Container API, quota, Kubernetes and GPU checks do not apply"
    )


def check_cpus(context: Context) -> Check:
    """A local node is devices_per_node processes, one CPU each (batchpilot.cluster.nodepool)."""
    from batchpilot.cluster.nodepool import available_cpus

    largest = context.found.get("plan")
    if largest is None:
        return skip("cpus", "no plan")
    cpus = available_cpus()
    if largest.num_devices > cpus:
        return fail(
            "cpus",
            f"the largest launch needs {largest.num_devices} local process(es), this machine has {cpus} CPU(s)",
            f"lower cluster.max_nodes or cluster.devices_per_node to fit {cpus} CPU(s), or run on more CPUs",
        )
    return ok("cpus", f"{largest.num_devices} process(es) for the largest launch, {cpus} CPU(s) here")
