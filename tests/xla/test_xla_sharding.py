"""The XLA runtime shards as torch_xla's FSDPv2 does (train/xla.py): every parameter, uneven sizes and 1-D
ones included, on its largest dimension; each block's output sharded along the batch; an optimization
barrier at the end of each block's backward. Read from the sharding annotations and the HLO that
torch_xla builds for a real model on 4 virtual CPU devices."""

from __future__ import annotations

import textwrap

from xla_helpers import run_script

N_LAYER = 2

PROBE = textwrap.dedent(
    f"""
    import contextlib, json
    import torch, torch_xla, torch_xla.runtime as xr
    xr.use_spmd()
    from batchpilot.models.deferred import build_deferred
    from batchpilot.models.factory import build_model
    from batchpilot.train.step import micro_batch_loss
    from batchpilot.train.xla import make_layout, place_streamed, shard_blocks
    from batchpilot.train.xla_state import send_rows

    # As the trainer places it: built on meta, each parameter made, uploaded and sharded in turn.
    deferred = build_deferred(lambda: build_model(
        factory="batchpilot.models.gpt:build",
        args={{"n_layer": {N_LAYER}, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 257}},
    ))
    model = deferred.model
    layout = make_layout(strategy="fsdp", num_devices=4, devices_per_node=2)
    torch.manual_seed(0)
    sharded = place_streamed(model, layout, deferred.stream)
    blocks = shard_blocks(model, layout)
    loss = micro_batch_loss(model, send_rows(torch.randint(0, 257, (8, 33)), layout), contextlib.nullcontext())
    forward = torch_xla._XLAC._get_xla_tensors_hlo([loss])
    loss.backward()
    backward = torch_xla._XLAC._get_xla_tensors_hlo([p.grad for p in model.parameters()])
    print(json.dumps({{
        "sharded": sharded,
        "blocks": blocks,
        "specs": {{n: torch_xla._XLAC._get_xla_sharding_spec(p) for n, p in model.named_parameters()}},
        "shapes": {{n: list(p.shape) for n, p in model.named_parameters()}},
        "batch_sharded_outputs": sum(
            'custom_call_target="Sharding"' in line and "f32[8,32,32]" in line and "devices=[4,1,1]" in line
            for line in forward.splitlines()
        ),
        "barriers": sum("opt-barrier(" in line for line in backward.splitlines()),
    }}))
    """
)


def probe() -> dict:
    return run_script(PROBE, num_devices=4)


def test_every_parameter_is_sharded_on_its_largest_dimension_and_blocks_follow_fsdpv2():
    found = probe()
    specs, shapes = found["specs"], found["shapes"]
    assert found["sharded"] == len(specs)
    # No parameter replicated: 1-D norms and biases too, and the 257-row embedding that 4 does not divide.
    assert {name for name, spec in specs.items() if "devices=" not in spec} == set()
    assert shapes["wte.weight"] == [257, 32] and specs["wte.weight"].startswith("{devices=[4,1]")
    assert specs["blocks.0.ln_1.weight"].startswith("{devices=[4]")
    # The MLP's down projection (32 x 128) is split along its 128 columns, as FSDPv2's shard_maximal does.
    assert shapes["blocks.0.mlp.2.weight"] == [32, 128] and specs["blocks.0.mlp.2.weight"].startswith(
        "{devices=[1,4]"
    )
    assert found["blocks"] == N_LAYER
    # shard_output: each block's [batch, seq, embd] output annotated split over the batch.
    assert found["batch_sharded_outputs"] == N_LAYER
    # The backward optimization barrier of each block.
    assert found["barriers"] >= N_LAYER
