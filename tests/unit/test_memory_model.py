"""The per-device memory model on NeMo's GPT-3 5B example (configs/nemo_gpt3_5b.yaml) and the strategy choice."""

import pytest

from batchpilot.errors import BatchpilotError
from batchpilot.planning import LRSchedule, megatron_rampup, plan_stages
from batchpilot.planning.activations import activation_bytes_per_sample
from batchpilot.planning.devices import device_memory_bytes
from batchpilot.planning.memory import MemoryEstimate, MemoryPlan, estimate_memory, plan_memory, shard_degree
from batchpilot.planning.model_shape import ModelShape
from batchpilot.planning.nodes import Placement

GIB = 2**30
H100 = device_memory_bytes("nvidia-h100-80gb")

# GPT (batchpilot.models.gpt, tied head): vocab*h + block_size*h + layers*(12h^2 + 13h) + 2h.
H, LAYERS, VOCAB, SEQ, HEADS = 4096, 24, 51200, 2048, 32
BLOCK = 12 * H * H + 13 * H
GPT_5B = ModelShape(
    num_params=VOCAB * H + SEQ * H + LAYERS * BLOCK + 2 * H,
    num_layers=LAYERS,
    hidden_size=H,
    vocab_size=VOCAB,
    ffn_hidden_size=4 * H,
    largest_block_params=BLOCK,
    num_heads=HEADS,
)
STAGES = plan_stages(
    schedule=megatron_rampup(start=256, increment=256, ramp_samples=10_000_000, target=2048),
    total_samples=20_000_000,
    micro_batch_size=4,
    lr_schedule=LRSchedule(
        lr=1.6e-4,
        scaling="none",
        reference_batch=2048,
        warmup_samples=0,
        decay="constant",
        decay_end_samples=0,
        min_lr_ratio=0,
    ),
    placement=Placement(devices_per_node=8, max_nodes=16, min_nodes=1),
).stages


def plan(requested="auto", *, device=H100, checkpointing=False, measured=None, mixed=True):
    return plan_memory(
        requested=requested,
        shape=GPT_5B,
        stages=STAGES,
        devices_per_node=8,
        seq_len=SEQ,
        mixed_precision=mixed,
        activation_checkpointing=checkpointing,
        activation_bytes_per_sample=measured,
        device_memory_bytes=device,
    )


def estimate(strategy, *, world_size=64, **overrides):
    args = dict(
        shape=GPT_5B,
        strategy=strategy,
        world_size=world_size,
        devices_per_node=8,
        micro_batch_size=4,
        seq_len=SEQ,
        mixed_precision=True,
        activation_checkpointing=False,
    )
    return estimate_memory(**{**args, **overrides})


def test_the_example_is_the_5b_model_on_8_to_16_nodes():
    assert GPT_5B.num_params == 5_051_228_160
    assert [stage.num_nodes for stage in STAGES] == [8, 8, 8, 8, 10, 12, 14, 16]


def test_ddp_does_not_fit_an_h100_and_is_refused_naming_what_fits():
    # Replicated fp32 params, grads + DDP buckets and AdamW alone are 20 B/param: 94 GiB.
    assert estimate("ddp").total > 100 * GIB
    with pytest.raises(BatchpilotError) as error:
        plan("ddp")
    message = str(error.value)
    assert message.startswith("train.parallelism: ddp needs ")
    assert "\n" not in message
    assert "at stage stage-0" in message and "the device's 79.6 GiB" in message
    assert "(fix: use hsdp (peak 45.6 GiB) or fsdp (peak 36.5 GiB))" in message


def test_auto_picks_hsdp_and_both_sharded_strategies_fit_every_stage():
    chosen = plan()
    assert chosen.strategy == "hsdp" and chosen.fits is True
    assert all(item.estimate.shard_degree == 8 for item in chosen.stages)
    assert 40 * GIB < chosen.peak.estimate.total < 80 * GIB
    fsdp = plan("fsdp")
    assert fsdp.fits is True and fsdp.peak.estimate.total < chosen.peak.estimate.total


def test_fsdp_per_device_memory_shrinks_as_stages_grow():
    stages = plan("fsdp").stages
    totals = [item.estimate.total for item in stages]
    by_nodes = dict(zip([stage.num_nodes for stage in STAGES], totals, strict=True))
    assert list(by_nodes) == [8, 10, 12, 14, 16]
    assert list(by_nodes.values()) == sorted(by_nodes.values(), reverse=True)
    assert by_nodes[8] > by_nodes[16]
    assert [item.estimate.shard_degree for item in stages] == [64, 64, 64, 64, 80, 96, 112, 128]
    assert plan("fsdp").peak.stage == "stage-0"


def test_hsdp_breakdown_in_bytes():
    e = estimate("hsdp")
    n = GPT_5B.num_params
    assert (e.parameters, e.gradients, e.optimizer) == (4 * n // 8, 4 * n // 8, 8 * n // 8)
    # The tied embeddings, final norm and head are one unit: gathered, with their unsharded gradient and its
    # fp32 reduce-scatter input (2 + 2 + 4 bytes per parameter), through the whole backward, beside two
    # gathered blocks (2 bytes) and one block's gradient with its fp32 reduce-scatter input (2 + 4).
    outer = VOCAB * H + SEQ * H + 2 * H
    assert e.unsharded_working_set == (2 + 2 + 4) * outer + 2 * 2 * BLOCK + (2 + 4) * BLOCK
    # NCCL: hsdp's three communicators (world, shard group, replicate group), 2 x 32 channels x 4 MiB each.
    assert e.communication == 3 * 2 * 32 * 4 * 2**20
    # Per token of a block, bf16 residual under FSDP: two LayerNorms (input 2h + 8 bytes of statistics
    # each), their outputs 2 x 2h, QKV 6h, the output projection's input 2h, 32 fp32 log-sum-exps, GELU's
    # input and output 2 x 8h: 32h + 16 + 4 x 32. The final norm's (2h + 8) and head's (2h) inputs, 12 bytes
    # per logit.
    assert e.activations == 4 * SEQ * (LAYERS * (32 * H + 16 + 4 * HEADS) + 4 * H + 8 + 12 * VOCAB)
    assert e.reserve == GIB + -(-5 * (e.total - e.reserve) // 100)
    assert e.activations_source == "estimate"


def test_the_breakdown_sums_to_the_total_and_survives_plan_json():
    chosen = plan()
    for item in chosen.stages:
        e = item.estimate
        parts = [e.parameters, e.gradients, e.optimizer, e.unsharded_working_set, e.activations, e.reserve]
        parts.append(e.communication)
        assert sum(parts) == e.total
    document = chosen.to_dict()
    assert document["strategy"] == "hsdp" and document["peak_stage"] == "stage-0"
    assert document["device_memory_bytes"] == H100 and document["fits"] is True
    first = document["stages"][0]
    assert first["stage"] == "stage-0" and first["total_bytes"] == chosen.stages[0].estimate.total
    assert all(isinstance(value, int | str) for value in first.values())
    assert MemoryPlan.from_dict(document) == chosen


def test_describe_is_one_line_in_gib():
    text = estimate("hsdp").describe()
    assert text == (
        "45.6 GiB = params 2.4 + grads 2.4 + optimizer 4.7 + working set 3.5"
        " + activations 28.8 (estimate) + NCCL 0.8 + reserve 3.1"
    )


def test_activation_checkpointing_keeps_block_inputs_only():
    full = estimate("fsdp").activations
    checkpointed = estimate("fsdp", activation_checkpointing=True).activations
    # 24 bf16 block inputs + one block recomputed + head + logits instead of 24 blocks' activations.
    assert checkpointed == 4 * SEQ * (LAYERS * 2 * H + (32 * H + 16 + 4 * HEADS) + 4 * H + 8 + 12 * VOCAB)
    assert checkpointed < full / 3  # the loss's 12 bytes per logit stay
    # Under ddp's autocast the residual stream stays fp32: the 24 block inputs, and the inputs of the
    # recomputed block's two LayerNorms and of the final one.
    ddp = estimate("ddp", activation_checkpointing=True).activations
    assert ddp - checkpointed == 4 * SEQ * (LAYERS * 2 * H + 2 * 2 * H + 2 * H)


def test_explore_measured_activations_replace_the_estimate():
    e = estimate("hsdp", activation_bytes_per_sample=2.5 * GIB)
    assert e.activations == 10 * GIB and e.activations_source == "explore"
    assert "activations 10.0 (explore)" in e.describe()
    # A larger measured slope than the estimate pushes hsdp off the device and auto on to fsdp.
    assert plan(measured=17 * GIB).strategy == "fsdp"
    assert plan(measured=1 * GIB).strategy == "hsdp"


def test_when_nothing_fits_the_fix_names_micro_batch_checkpointing_and_devices():
    l4 = device_memory_bytes("nvidia-l4")
    with pytest.raises(BatchpilotError) as error:
        plan(device=l4)
    message = str(error.value)
    assert message.startswith("train.parallelism: no strategy fits: even fsdp needs ")
    assert "batch.micro_batch_size" in message and "train.activation_checkpointing: true" in message
    assert "more devices" in message and "\n" not in message
    # With checkpointing hsdp needs 23.0 GiB, just over a 22.5 GiB L4 (NCCL's buffers and the fp32
    # reduce-scatter input tip it), so fsdp; a 15 GiB T4 needs fsdp too.
    assert estimate("hsdp", activation_checkpointing=True).total > l4
    assert plan(device=l4, checkpointing=True).strategy == "fsdp"
    assert plan(device=device_memory_bytes("nvidia-tesla-t4"), checkpointing=True).strategy == "fsdp"
    with pytest.raises(BatchpilotError, match=r"hsdp needs .* \(fix: use fsdp"):
        plan("hsdp", device=device_memory_bytes("nvidia-tesla-t4"), checkpointing=True)


def test_unknown_device_memory_is_not_checked():
    assert plan(device=None).strategy == "ddp" and plan(device=None).fits is None
    assert plan("fsdp", device=None).strategy == "fsdp"
    assert plan("ddp", device=None).to_dict()["fits"] is None


def test_fp32_widens_the_working_set_and_drops_autocast_copies():
    mixed, fp32 = estimate("fsdp"), estimate("fsdp", mixed_precision=False)
    # fp32 parameters and gradients take 4 bytes instead of 2; the reduce-scatter input is fp32 either way.
    outer = VOCAB * H + SEQ * H + 2 * H
    assert mixed.unsharded_working_set == (2 + 2 + 4) * outer + 2 * 2 * BLOCK + (2 + 4) * BLOCK
    assert fp32.unsharded_working_set == (4 + 4 + 4) * outer + 2 * 4 * BLOCK + (4 + 4) * BLOCK
    assert fp32.activations == 4 * SEQ * (LAYERS * (64 * H + 16 + 4 * HEADS) + 8 * H + 8 + 12 * VOCAB)
    assert estimate("ddp", mixed_precision=False).unsharded_working_set == 0
    assert estimate("ddp").unsharded_working_set == 2 * GPT_5B.num_params


def test_a_model_without_blocks_is_one_fsdp_unit():
    shape = ModelShape(
        num_params=1000,
        num_layers=0,
        hidden_size=8,
        vocab_size=100,
        ffn_hidden_size=0,
        largest_block_params=0,
    )
    e = estimate_memory(
        shape=shape,
        strategy="fsdp",
        world_size=4,
        devices_per_node=2,
        micro_batch_size=2,
        seq_len=16,
        mixed_precision=False,
        activation_checkpointing=True,
        reserve_fixed_bytes=0,
    )
    # all parameters, their gradients and the gradients' reduce-scatter input, fp32
    assert e.unsharded_working_set == 3 * 1000 * 4
    assert e.communication == 0  # no CUDA context: gloo, no NCCL buffers
    assert (e.parameters, e.optimizer) == (1000, 2000)
    assert e.activations == 2 * 16 * (8 * 4 + 8 + 4 * 8 + 12 * 100)  # final LayerNorm, head input, loss
    assert e.reserve == -(-5 * (e.total - e.reserve) // 100)


def test_shard_degree():
    assert shard_degree("ddp", world_size=64, devices_per_node=8) == 1
    assert shard_degree("fsdp", world_size=64, devices_per_node=8) == 64
    assert shard_degree("hsdp", world_size=64, devices_per_node=8) == 8
    assert shard_degree("hsdp", world_size=4, devices_per_node=8) == 4


@pytest.mark.parametrize(
    ("points", "slope"),
    [
        ([(1, 100), (2, 300), (4, 700)], 200.0),  # exact line
        ([(1, 10), (2, 30), (3, 20)], 5.0),  # least squares through noise
        ([(2, 500), (2, 700), (4, 900)], 150.0),  # repeats average out
        ([(1, 500), (2, 400)], 0.0),  # noise that would make activations negative
        ([(2, 5), (2, 7)], None),  # one micro batch size: no slope
        ([(4, 5)], None),
        ([], None),
    ],
)
def test_activation_bytes_per_sample(points, slope):
    assert activation_bytes_per_sample(points) == slope


def test_estimates_are_frozen_and_round_trip():
    e = estimate("fsdp")
    assert MemoryEstimate.from_dict(e.to_dict()) == e
    with pytest.raises(AttributeError):
        e.activations = 0
