"""The Llama model: shapes, causality, GQA, rotary positions, checkpointing, meta-device materialisation."""

import math

import pytest
import torch
from torch.nn import functional as F

from batchpilot.errors import BatchpilotError
from batchpilot.models import llama
from batchpilot.models.factory import build_model
from batchpilot.models.llama import Llama, LlamaConfig, build

SMALL = {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "max_seq_len": 16, "vocab_size": 64}


def tokens(batch: int = 2, seq: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


def loss_of(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def test_forward_maps_tokens_to_logits():
    torch.manual_seed(0)
    model = build(**SMALL)
    assert model(tokens(3, 10)).shape == (3, 10, SMALL["vocab_size"])
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2


def test_a_sequence_longer_than_max_seq_len_names_the_key():
    model = build(**SMALL)
    with pytest.raises(ValueError, match=r"sequence length 17 exceeds model.args.max_seq_len 16"):
        model(tokens(1, 17))


def test_a_later_token_does_not_change_earlier_logits():
    torch.manual_seed(0)
    model = build(**SMALL).eval()
    idx = tokens(1, 12)
    changed = idx.clone()
    changed[0, 8] = (changed[0, 8] + 1) % SMALL["vocab_size"]
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :8], after[:, :8])
    assert not torch.allclose(before[:, 8:], after[:, 8:])


def test_grouped_query_attention_has_fewer_parameters_and_matches_repeated_heads(monkeypatch):
    def count(model: torch.nn.Module) -> int:
        return sum(p.numel() for p in model.parameters())

    grouped, full = build(**SMALL), build(**{**SMALL, "n_kv_head": 4})
    head_dim = SMALL["n_embd"] // SMALL["n_head"]
    # wk and wv shrink from 4 to 2 heads in each block.
    assert count(full) - count(grouped) == SMALL["n_layer"] * 2 * SMALL["n_embd"] * 2 * head_dim
    grouped.eval()
    with torch.no_grad():
        native = grouped(tokens())
        monkeypatch.setattr(llama, "_SDPA_HAS_GQA", False)  # the repeat_interleave path of older torch
        repeated = grouped(tokens())
    torch.testing.assert_close(native, repeated)


def test_rotary_attention_scores_depend_only_on_relative_position():
    cos, sin = llama.rope_tables(head_dim=8, max_seq_len=16, theta=10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(q_pos: int, k_pos: int) -> float:
        rotated_q = llama.apply_rope(q, cos[q_pos], sin[q_pos])
        rotated_k = llama.apply_rope(k, cos[k_pos], sin[k_pos])
        return float((rotated_q * rotated_k).sum())

    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)


def test_default_ffn_width_follows_llamas_rule():
    # Llama 2 7B: 4096 wide -> int(2/3 x 16384) = 10922, rounded up to a multiple of 256.
    config = LlamaConfig(n_embd=4096, n_head=32, n_kv_head=32)
    assert config.resolved_ffn_hidden_size == 11008
    assert build(**SMALL).ffn_hidden_size == 256
    assert build(**SMALL, ffn_hidden_size=48).ffn_hidden_size == 48
    assert build(**SMALL, ffn_hidden_size=48).blocks[0].feed_forward.w1.out_features == 48


def test_no_biases_untied_head_by_default_and_tying_shares_the_weight():
    model = build(**SMALL)
    assert all(not name.endswith("bias") for name, _ in model.named_parameters())
    assert model.output.weight is not model.tok_embeddings.weight
    tied = build(**SMALL, tie_embeddings=True)
    assert tied.output.weight is tied.tok_embeddings.weight
    untied_count = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in tied.parameters()) == untied_count - SMALL["vocab_size"] * SMALL["n_embd"]


def test_residual_projections_start_smaller():
    torch.manual_seed(0)
    model = build(n_layer=8, n_head=4, n_kv_head=4, n_embd=256, max_seq_len=8, vocab_size=64)
    assert float(model.blocks[0].attention.wq.weight.detach().std()) == pytest.approx(0.02, rel=0.05)
    expected = 0.02 / math.sqrt(2 * 8)
    assert float(model.blocks[0].attention.wo.weight.detach().std()) == pytest.approx(expected, rel=0.05)
    assert float(model.blocks[0].feed_forward.w2.weight.detach().std()) == pytest.approx(expected, rel=0.05)


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    torch.manual_seed(0)
    model = build(**SMALL)
    idx = tokens()
    loss = loss_of(model, idx)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model.set_activation_checkpointing(True)
    checkpointed = loss_of(model, idx)
    checkpointed.backward()
    torch.testing.assert_close(checkpointed, loss)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], msg=name)


def test_a_few_steps_on_a_repeated_batch_reduce_the_loss():
    torch.manual_seed(0)
    model = build(**SMALL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = tokens(4, 16)
    losses = []
    for _ in range(10):
        loss = loss_of(model, idx)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def test_a_meta_built_model_materialises_with_to_empty_and_init_weights():
    with torch.device("meta"):
        model = build(**SMALL)
    assert model.rope_cos.is_meta and model.output.weight.is_meta
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    reference = build(**SMALL)
    torch.testing.assert_close(model.rope_cos, reference.rope_cos)
    torch.testing.assert_close(model.rope_sin, reference.rope_sin)
    assert torch.isfinite(loss_of(model, tokens()))
    # Loading a checkpoint instead of init_weights: the rotary tables are not in the state dict, so
    # reset_buffers() is what makes the model match one built on the CPU.
    assert not any(key.startswith("rope_") for key in reference.state_dict())
    with torch.device("meta"):
        loaded = build(**SMALL)
    loaded.to_empty(device="cpu")
    loaded.load_state_dict(reference.state_dict())
    loaded.reset_buffers()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens()), reference(tokens()))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"n_layers": 2}, "model.args: unknown key 'n_layers' for batchpilot.models.llama"),
        ({"n_layer": 0}, "model.args.n_layer must be positive, got 0"),
        ({"n_embd": 30, "n_head": 4}, r"model.args.n_embd \(30\) must be a multiple of n_head \(4\)"),
        ({"n_embd": 12, "n_head": 4, "n_kv_head": 4}, r"model.args.n_embd / n_head \(3\) must be even"),
        ({"n_head": 4, "n_kv_head": 3}, r"model.args.n_kv_head \(3\) must divide n_head \(4\)"),
        ({"ffn_hidden_size": 0}, "model.args.ffn_hidden_size must be positive, got 0"),
        ({"rope_theta": 0.0}, "model.args.rope_theta must be positive"),
    ],
)
def test_build_rejects_bad_args_naming_the_key(args, message):
    with pytest.raises(ValueError, match=message):
        build(**args)


def test_the_factory_reports_bad_args_as_one_line():
    with pytest.raises(BatchpilotError, match=r"model.args: batchpilot.models.llama:build rejected"):
        build_model(factory="batchpilot.models.llama:build", args={"n_kv_heads": 2})
    assert isinstance(build_model(factory="batchpilot.models.llama:build", args=SMALL), Llama)
