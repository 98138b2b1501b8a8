"""#38: the XLA runtime's noise terms are unbiased, checked against exact per-example gradients (as
tests/integration/test_noise_unbiased.py checks the eager ranks' own gradients).

Under SPMD no device's own gradient is exposed (the reduction is inside the compiled step), so at
accumulation 1 the XLA trainer runs each device's rows as two halves and takes the first half over all
devices as the small batch (`XlaRuntime.run_passes`). Here, on 4 virtual CPU devices, a tiny GPT's weights
are fixed; a population of 48 sequences gives, on the CPU, the true gradient G (the mean of the per-example
gradients) and tr(Sigma) (the mean of |g_i - G|^2). Then 100 steps of the XLA runtime's passes (micro batch 2
per device, split) on batches drawn with replacement from the population: each step's |G|^2 and S
(`noise_terms` of the first half's squared norm at batch 4 and the step's at batch 8) average to the exact
values within 4 standard errors of the steps' spread; with the small batch taken as one device's half (1 row)
or one device's micro batch (2) they are not.
"""

from __future__ import annotations

import statistics
import textwrap

from xla_helpers import run_script

from batchpilot.train.noise import noise_terms

POPULATION, DEVICES, MICRO, STEPS = 48, 4, 2, 100

SCRIPT = textwrap.dedent(
    f"""
    import contextlib, json
    import torch, torch_xla
    from batchpilot.models.deferred import build_deferred
    from batchpilot.models.factory import build_model
    from batchpilot.train.runtime import Passes
    from batchpilot.train.step import micro_batch_loss
    from batchpilot.train.xla import make_layout, place_streamed, shard_blocks, start_runtime
    from batchpilot.train.xla_runtime import XlaRuntime, _gradients, _sq_norm

    ARGS = {{"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64}}
    host = start_runtime()
    assert host.num_devices == {DEVICES}, host
    layout = make_layout(strategy="fsdp", num_devices={DEVICES}, devices_per_node={DEVICES})
    runtime = XlaRuntime(host, layout)
    deferred = build_deferred(lambda: build_model(factory="batchpilot.models.gpt:build", args=ARGS))
    model = deferred.model
    torch.manual_seed(0)
    place_streamed(model, layout, deferred.stream)
    shard_blocks(model, layout)

    # The exact values, on the CPU, from the same weights.
    reference = build_model(factory="batchpilot.models.gpt:build", args=ARGS)
    reference.load_state_dict({{name: value.cpu() for name, value in model.state_dict().items()}})
    samples = torch.randint(0, 64, ({POPULATION}, 17), generator=torch.Generator().manual_seed(3))
    per_example = []
    for row in samples:
        reference.zero_grad(set_to_none=True)
        micro_batch_loss(reference, row[None], contextlib.nullcontext()).backward()
        per_example.append(torch.cat([p.grad.flatten().double() for p in reference.parameters()]))
    grads = torch.stack(per_example)
    mean = grads.mean(0)
    exact = {{"g2": float(mean.pow(2).sum()), "s": float((grads - mean).pow(2).sum(1).mean())}}

    norms = []
    passes = Passes(micro_batch_size={MICRO}, split=True, measure_noise=True, measure_coherence=False)
    big = {MICRO} * {DEVICES}
    for step in range({STEPS}):
        draw = torch.randint(0, {POPULATION}, (big,), generator=torch.Generator().manual_seed(1000 + step))
        outcome = runtime.run_passes(model, [samples[draw]], passes)
        big_sq = _sq_norm(_gradients(model))
        torch_xla.sync()
        norms.append([float(outcome.small_sq_norm.item()), float(big_sq.item()), outcome.small_batch])
        model.zero_grad(set_to_none=True)
    print(json.dumps({{"exact": exact, "norms": norms}}))
    """
)


def run_steps() -> dict:
    return run_script(SCRIPT, num_devices=DEVICES)


def within(norms: list, exact: dict, *, b_small: int) -> list[bool]:
    """Whether the steps' mean |G|^2 and S, with the small batch taken as `b_small`, are within 4 standard
    errors of the exact values."""
    terms = [
        noise_terms(small_sq_norm=small, big_sq_norm=big, b_small=b_small, b_big=MICRO * DEVICES)
        for small, big, _ in norms
    ]
    return [
        abs(statistics.fmean(values) - exact[name]) < 4 * statistics.stdev(values) / len(values) ** 0.5
        for name, values in (("g2", [t[0] for t in terms]), ("s", [t[1] for t in terms]))
    ]


def test_the_xla_runtimes_split_step_noise_terms_average_to_the_exact_values():
    found = run_steps()
    exact, norms = found["exact"], found["norms"]
    small_batches = {small_batch for _, _, small_batch in norms}
    assert small_batches == {MICRO // 2 * DEVICES}  # the first half over every device
    assert within(norms, exact, b_small=small_batches.pop()) == [True, True]
    # The test can tell: the small batch taken as one device's half, or as one device's micro batch, fails it.
    assert within(norms, exact, b_small=MICRO // 2) != [True, True]
    assert within(norms, exact, b_small=MICRO) != [True, True]
