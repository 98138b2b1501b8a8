"""Checks the trainer makes before it touches a model: resume point, data order, vocabulary, stages."""

from pathlib import Path

import pytest
import yaml
from torch import nn

from batchpilot.config import parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.stages import build_plan
from batchpilot.storage import LocalStorage
from batchpilot.train.checkpoint import Checkpoint
from batchpilot.train.setup import (
    check_resume_point,
    check_same_data_order,
    check_vocabulary,
    data_order,
)
from helpers import REPO


def demo_config(**data):
    raw = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    raw["data"].update(data)
    return parse_config(raw)


def checkpoint(consumed: int, meta: dict | None = None) -> Checkpoint:
    return Checkpoint(
        step=1,
        consumed_samples=consumed,
        rng={},
        meta=meta or {},
        folder="000000001",
        storage=LocalStorage(Path(".")),
    )


def test_resume_point_must_lie_in_the_stages():
    plan = build_plan(demo_config(), micro_batch_size=8)
    stage1 = list(plan.select("1"))
    assert check_resume_point(stages=stage1, checkpoint=checkpoint(1376), uri="file://x") == 1376
    with pytest.raises(BatchpilotError, match="starts at sample 1,376 but file://x holds no checkpoint"):
        check_resume_point(stages=stage1, checkpoint=None, uri="file://x")
    with pytest.raises(BatchpilotError, match="before stage-1 starts"):
        check_resume_point(stages=stage1, checkpoint=checkpoint(16), uri="file://x")
    with pytest.raises(BatchpilotError, match="past the end of stage-1"):
        check_resume_point(stages=stage1, checkpoint=checkpoint(4096), uri="file://x")
    with pytest.raises(BatchpilotError, match="is not a stage of this plan"):
        plan.select("9", allow_all=True)
    assert plan.select("all", allow_all=True) == plan.stages and plan.select("final") == plan.stages[-1:]
    with pytest.raises(BatchpilotError, match=r"use 0\.\.3 or final"):
        plan.select("all")


def test_resuming_with_another_sample_order_is_refused():
    saved = checkpoint(64, {"data_order": data_order(demo_config())})
    check_same_data_order(demo_config(), saved)
    with pytest.raises(
        BatchpilotError, match=r"data\.shuffle_block_samples: is 64 but the checkpoint was trained with 128"
    ):
        check_same_data_order(demo_config(shuffle_block_samples=64), saved)


def test_vocabulary_must_cover_the_dataset():
    check_vocabulary(nn.Embedding(257, 4), vocab_size=257)
    with pytest.raises(BatchpilotError, match=r"model\.args\.vocab_size: the model embeds 256 token ids"):
        check_vocabulary(nn.Embedding(256, 4), vocab_size=257)


@pytest.mark.parametrize(
    ("factory", "args", "message"),
    [
        ("no_such_module:build", {}, "model.factory: cannot import 'no_such_module'"),
        ("batchpilot.models.gpt:nope", {}, "model.factory: 'batchpilot.models.gpt' has no function 'nope'"),
        ("batchpilot.models.gpt:build", {"n_layers": 2}, "model.args: batchpilot.models.gpt:build rejected"),
        ("batchpilot.models.gpt:build", {"n_embd": 30, "n_head": 4}, "must be a multiple of n_head"),
        ("batchpilot.models.gpt:GPTConfig", {}, "returned GPTConfig, not a torch.nn.Module"),
    ],
)
def test_broken_model_factories_are_one_line_errors(factory, args, message):
    from batchpilot.models.factory import build_model

    with pytest.raises(BatchpilotError) as info:
        build_model(factory=factory, args=args)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_activation_checkpointing_gives_the_same_gradients():
    import torch

    from batchpilot.models.gpt import build

    torch.manual_seed(0)
    model = build(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    tokens = torch.randint(0, 64, (4, 16))
    grads = []
    for enabled in (False, True):
        model.zero_grad()
        model.set_activation_checkpointing(enabled)
        model(tokens).sum().backward()
        grads.append(model.wte.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_one_rank_measures_noise_and_coherence_from_its_micro_batches():
    import contextlib

    import torch

    from batchpilot.models.gpt import build
    from batchpilot.train.distributed import DistContext
    from batchpilot.train.parallel import wrap_model
    from batchpilot.train.step import accumulate_gradients

    torch.manual_seed(0)
    model = build(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    batches = [torch.randint(0, 64, (4, 17)) for _ in range(4)]
    ctx = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    outcome = accumulate_gradients(
        model=model,
        # one process: the bare model (built on the CPU here: nothing to materialise)
        parallel=wrap_model(model, ctx, strategy="fsdp", bf16=False, materialize=lambda _: None),
        micro_batches=batches,
        ctx=ctx,
        autocast=contextlib.nullcontext,
        measure_noise=True,
        measure_coherence=True,
    )
    assert outcome.completed and outcome.small_batch == 4
    global_sq = sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None)
    assert outcome.small_sq_norm > global_sq  # one micro-batch's gradient is noisier than the mean of four
    assert -1.0 <= outcome.coherence <= 1.0


def test_out_of_memory_in_the_last_backward_cannot_be_retried_in_place():
    """With accumulation 1 the only backward is the synchronising one: the OOM is reported as unagreed
    (the trainer then records the halved size and ends the job), not raised raw."""
    import contextlib

    import torch

    from batchpilot.models.gpt import build
    from batchpilot.train.distributed import DistContext
    from batchpilot.train.parallel import wrap_model
    from batchpilot.train.step import UnagreedOutOfMemory, accumulate_gradients

    class OutOfMemoryInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise torch.cuda.OutOfMemoryError("injected in backward")

    model = build(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    model.blocks[0].register_forward_hook(lambda module, inputs, output: OutOfMemoryInBackward.apply(output))
    ctx = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    with pytest.raises(UnagreedOutOfMemory) as raised:
        accumulate_gradients(
            model=model,
            parallel=wrap_model(model, ctx, strategy="ddp", bf16=False, materialize=lambda _: None),
            micro_batches=[torch.randint(0, 64, (4, 17))],
            ctx=ctx,
            autocast=contextlib.nullcontext,
            measure_noise=True,
            measure_coherence=False,
        )
    assert raised.value.micro_batch_size == 4
