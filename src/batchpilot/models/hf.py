"""Hugging Face checkpoints: batchpilot's built-in models as `transformers` models, and back.

Pure mapping of names, shapes and settings; `transformers` is never imported (a checkpoint written here
loads with `LlamaForCausalLM.from_pretrained` / `GPT2LMHeadModel.from_pretrained`, but writing it needs only
`safetensors`, imported when a file is read or written).

- `batchpilot.models.llama:build` is `LlamaForCausalLM`: both rotate the two halves of each head
  (`rotate_half`) with the same frequencies, so the q/k projections are copied as they are (no
  interleaved-pair permutation); RMSNorm, SwiGLU and grouped-query attention have no biases on either side.
- `batchpilot.models.gpt:build` is `GPT2LMHeadModel` with `activation_function: gelu` (the exact GELU of
  `nn.GELU()`, not GPT-2's tanh approximation), its fused qkv and MLP weights transposed into Conv1D's
  `[in, out]` layout, and the head tied to the token embedding. Without biases (`bias: false`) the GPT-2
  layers get zero biases, which compute the same function. Only the Llama is read back.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from batchpilot.errors import BatchpilotError

if TYPE_CHECKING:
    from torch import Tensor

LLAMA_FACTORY = "batchpilot.models.llama:build"
GPT_FACTORY = "batchpilot.models.gpt:build"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
INSTALL_FIX = "pip install 'batchpilot[hf]'"
_DEFAULT_ROPE_THETA = 10000.0  # transformers' default when config.json names none


def require(module: str) -> Any:
    """Imports `module` (safetensors, transformers), or refuses in one line naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.partition(".")[0]
        raise BatchpilotError(
            package, "is not installed; Hugging Face checkpoints need it", INSTALL_FIX
        ) from None


# --- batchpilot -> Hugging Face ------------------------------------------------------------------------------


def hf_config_for(factory: str, args: dict[str, Any]) -> dict[str, Any]:
    """The `config.json` of the Hugging Face model that computes what batchpilot's `factory(**args)` does.

    Raises:
        BatchpilotError: for a factory with no Hugging Face counterpart, or args the factory refuses.
    """
    if factory == LLAMA_FACTORY:
        return _llama_hf_config(args)
    if factory == GPT_FACTORY:
        return _gpt_hf_config(args)
    raise BatchpilotError(
        "model.factory",
        f"{factory} has no Hugging Face counterpart: export knows {LLAMA_FACTORY} (LlamaForCausalLM) and "
        f"{GPT_FACTORY} (GPT2LMHeadModel)",
        "train one of the built-in models to export it",
    )


def _model_config(factory: str, args: dict[str, Any]) -> Any:
    """The model's own config dataclass for `args`, with its defaults and checks."""
    if factory == LLAMA_FACTORY:
        from batchpilot.models.llama import LlamaConfig as config_class
    else:
        from batchpilot.models.gpt import GPTConfig as config_class  # type: ignore[assignment]
    unknown = sorted(set(args) - set(config_class.__dataclass_fields__))
    if unknown:
        raise BatchpilotError("model.args", f"unknown key {unknown[0]!r} for {factory}")
    try:
        return config_class(**args)
    except (TypeError, ValueError) as error:
        raise BatchpilotError("model.args", f"{factory} rejected its arguments: {error}") from None


def _llama_hf_config(args: dict[str, Any]) -> dict[str, Any]:
    config = _model_config(LLAMA_FACTORY, args)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.n_embd,
        "intermediate_size": config.resolved_ffn_hidden_size,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.norm_eps,
        # rope_theta for transformers 4.x, rope_parameters for 5.x (which folds the former into the latter).
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
    }


def _gpt_hf_config(args: dict[str, Any]) -> dict[str, Any]:
    config = _model_config(GPT_FACTORY, args)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": 4 * config.n_embd,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "vocab_size": config.vocab_size,
        "activation_function": "gelu",  # nn.GELU(): exact erf GELU, not GPT-2's gelu_new (tanh)
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
    }


def _llama_names(n_layer: int) -> list[tuple[str, str]]:
    """(batchpilot name, Hugging Face name) of every Llama weight but the output head."""
    names = [("tok_embeddings.weight", "model.embed_tokens.weight")]
    for i in range(n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        names += [
            (f"{ours}attention_norm.weight", f"{theirs}input_layernorm.weight"),
            (f"{ours}attention.wq.weight", f"{theirs}self_attn.q_proj.weight"),
            (f"{ours}attention.wk.weight", f"{theirs}self_attn.k_proj.weight"),
            (f"{ours}attention.wv.weight", f"{theirs}self_attn.v_proj.weight"),
            (f"{ours}attention.wo.weight", f"{theirs}self_attn.o_proj.weight"),
            (f"{ours}ffn_norm.weight", f"{theirs}post_attention_layernorm.weight"),
            (f"{ours}feed_forward.w1.weight", f"{theirs}mlp.gate_proj.weight"),
            (f"{ours}feed_forward.w3.weight", f"{theirs}mlp.up_proj.weight"),
            (f"{ours}feed_forward.w2.weight", f"{theirs}mlp.down_proj.weight"),
        ]
    return [*names, ("norm.weight", "model.norm.weight")]


def _gpt_names(n_layer: int) -> list[tuple[str, str, bool]]:
    """(batchpilot name, Hugging Face name, transposed) of every GPT weight and bias but the tied head;
    Conv1D holds its weight as `[in, out]`, nn.Linear as `[out, in]`."""
    names = [("wte.weight", "transformer.wte.weight", False), ("wpe.weight", "transformer.wpe.weight", False)]
    for i in range(n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for our_part, their_part, linear in (
            ("ln_1", "ln_1", False),
            ("attn.qkv", "attn.c_attn", True),
            ("attn.proj", "attn.c_proj", True),
            ("ln_2", "ln_2", False),
            ("mlp.0", "mlp.c_fc", True),
            ("mlp.2", "mlp.c_proj", True),
        ):
            names.append((f"{ours}{our_part}.weight", f"{theirs}{their_part}.weight", linear))
            names.append((f"{ours}{our_part}.bias", f"{theirs}{their_part}.bias", False))
    return [
        *names,
        ("ln_f.weight", "transformer.ln_f.weight", False),
        ("ln_f.bias", "transformer.ln_f.bias", False),
    ]


@dataclass(frozen=True)
class Source:
    """Where a Hugging Face weight comes from: batchpilot's tensor `ours`, as it is, transposed (GPT-2's
    Conv1D holds `[in, out]`), or a zero bias as long as `ours`' rows (a GPT built without biases)."""

    theirs: str
    ours: str
    how: Literal["same", "transposed", "zero_bias"] = "same"

    def convert(self, tensor: Tensor) -> Tensor:
        if self.how == "transposed":
            return tensor.t().contiguous()
        if self.how == "zero_bias":
            return tensor.new_zeros(tensor.shape[0])
        return tensor


def hf_sources(factory: str, args: dict[str, Any]) -> tuple[list[Source], tuple[str, str] | None]:
    """Every Hugging Face weight of the model's counterpart and where it comes from, in the order written,
    and the tied (head, embedding) pair, which transformers saves once (None: untied).

    Raises:
        BatchpilotError: for a factory `hf_config_for` refuses.
    """
    hf_config_for(factory, args)  # refuses what has no counterpart
    config = _model_config(factory, args)
    if factory == LLAMA_FACTORY:
        sources = [Source(theirs, ours) for ours, theirs in _llama_names(config.n_layer)]
        if config.tie_embeddings:
            return sources, ("output.weight", "tok_embeddings.weight")
        return [*sources, Source("lm_head.weight", "output.weight")], None
    sources = []
    for ours, theirs, transposed in _gpt_names(config.n_layer):
        if ours.endswith(".bias") and not config.bias:
            sources.append(Source(theirs, ours.removesuffix(".bias") + ".weight", "zero_bias"))
        else:
            sources.append(Source(theirs, ours, "transposed" if transposed else "same"))
    return sources, ("head.weight", "wte.weight")


def to_hf_state_dict(factory: str, args: dict[str, Any], state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """batchpilot's state dict (the model's `state_dict()`, or a checkpoint's `model` entries) under the
    Hugging Face model's names and layouts. A tied output head is left out, as transformers saves it.

    Raises:
        BatchpilotError: for a factory `hf_config_for` refuses, or a state dict that lacks a weight of the
            model or holds one it does not have.
    """
    sources, tied = hf_sources(factory, args)
    out = {source.theirs: source.convert(_take(state_dict, source.ours, factory)) for source in sources}
    used = {source.ours for source in sources if source.how != "zero_bias"}
    if tied is not None:
        head, embedding = tied
        check_tied(state_dict, head=head, embedding=embedding)
        used.add(head)
    extra = sorted(set(state_dict) - used)
    if extra:
        raise BatchpilotError(
            "model", f"the state dict holds {extra[0]}, which {factory} with these args does not have"
        )
    return out


def _take(state_dict: Mapping[str, Tensor], name: str, factory: str) -> Tensor:
    if name not in state_dict:
        raise BatchpilotError("model", f"the state dict lacks {name}, a weight of {factory}")
    return state_dict[name]


def check_tied(state_dict: Mapping[str, Tensor], *, head: str, embedding: str) -> None:
    """A tied head is the embedding: absent from the state dict, or equal to it."""
    import torch

    if head in state_dict and not torch.equal(state_dict[head], state_dict[embedding]):
        raise BatchpilotError(
            "model", f"{head} differs from {embedding}, but the model ties them (one weight)"
        )


# --- Hugging Face -> batchpilot ------------------------------------------------------------------------------


def llama_args_from_hf_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """batchpilot Llama args (`model.args` of `batchpilot.models.llama:build`) from a `config.json`.

    Raises:
        BatchpilotError: naming the first field that describes another architecture or a feature
            batchpilot's Llama does not have (scaled rotary, biases, another activation, ...).
    """
    _check_llama_architecture(hf_config)
    get = _reader(hf_config)
    n_embd, n_head = get(HF_CONFIG_KEYS["n_embd"], int), get(HF_CONFIG_KEYS["n_head"], int)
    n_kv_head = hf_config.get(HF_CONFIG_KEYS["n_kv_head"]) or n_head
    for field, ours in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if field in hf_config and hf_config[field] != ours:
            _refuse_feature(field, hf_config[field], f"batchpilot's Llama has {field} {json.dumps(ours)}")
    head_dim = hf_config.get("head_dim")
    if head_dim is not None and head_dim * n_head != n_embd:
        _refuse_feature(
            "head_dim", head_dim, f"batchpilot's Llama has head_dim = hidden_size / num_attention_heads = "
            f"{n_embd} / {n_head}",
        )  # fmt: skip
    if hf_config.get("pretraining_tp", 1) not in (1, None):
        _refuse_feature(
            "pretraining_tp", hf_config["pretraining_tp"], "batchpilot's Llama computes in one part"
        )
    key = HF_CONFIG_KEYS
    args = {
        "n_layer": get(key["n_layer"], int),
        "n_head": n_head,
        "n_kv_head": int(n_kv_head),
        "n_embd": n_embd,
        "max_seq_len": int(hf_config.get("max_position_embeddings", 2048)),
        "vocab_size": get(key["vocab_size"], int),
        "ffn_hidden_size": get(key["ffn_hidden_size"], int),
        "rope_theta": _rope_theta(hf_config),
        "norm_eps": float(hf_config.get(key["norm_eps"], 1e-6)),
        "tie_embeddings": bool(hf_config.get(key["tie_embeddings"], False)),
    }
    try:
        _model_config(LLAMA_FACTORY, args)
    except BatchpilotError as error:
        raise BatchpilotError(
            CONFIG_FILE, f"describes a model batchpilot's Llama cannot be: {error.problem}"
        ) from None
    return args


def _check_llama_architecture(hf_config: Mapping[str, Any]) -> None:
    architectures = hf_config.get("architectures") or []
    model_type = hf_config.get("model_type")
    if model_type != "llama" or (architectures and architectures != ["LlamaForCausalLM"]):
        what = ", ".join(architectures) or "model without architectures"
        raise BatchpilotError(
            CONFIG_FILE,
            f"describes a {what} (model_type {model_type}); batchpilot reads LlamaForCausalLM",
        )


def _reader(hf_config: Mapping[str, Any]) -> Callable[[str, type], Any]:
    def get(field: str, kind: type) -> Any:
        if hf_config.get(field) is None:
            raise BatchpilotError(CONFIG_FILE, f"has no {field}", "give a config.json of a LlamaForCausalLM")
        return kind(hf_config[field])

    return get


def _refuse_feature(field: str, value: Any, why: str) -> None:
    raise BatchpilotError(
        CONFIG_FILE, f"sets {field} {json.dumps(value)}, which batchpilot's Llama does not have ({why})"
    )


def _rope_theta(hf_config: Mapping[str, Any]) -> float:
    """The rotary base of an unscaled rotary embedding (`rope_scaling` in transformers 4.x, `rope_parameters`
    in 5.x, whose `rope_type: default` is plain rotary)."""
    theta = hf_config.get("rope_theta")
    for field in ("rope_scaling", "rope_parameters"):
        parameters = hf_config.get(field)
        if not parameters:
            continue
        kind = parameters.get("rope_type", parameters.get("type", "default"))
        scaled = {key for key in parameters if key not in ("rope_type", "type", "rope_theta")}
        if (
            kind != "default"
            or scaled - {"partial_rotary_factor"}
            or parameters.get("partial_rotary_factor", 1) != 1
        ):
            _refuse_feature(field, parameters, "it has plain, unscaled rotary positions on the whole head")
        theta = parameters.get("rope_theta", theta)
    return float(theta if theta is not None else _DEFAULT_ROPE_THETA)


def llama_weight_names(args: Mapping[str, Any]) -> dict[str, str]:
    """Hugging Face name -> batchpilot name of every weight a LlamaForCausalLM of `args` (as
    `llama_args_from_hf_config` gives them) is loaded from; a tied head has none of its own."""
    names = {theirs: ours for ours, theirs in _llama_names(args["n_layer"])}
    if not args["tie_embeddings"]:
        names["lm_head.weight"] = "output.weight"
    return names


def from_hf_state_dict(
    hf_config: dict[str, Any], hf_state_dict: dict[str, Tensor]
) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    """(model.factory, model.args, state dict) of the batchpilot Llama a Hugging Face Llama checkpoint is.

    The state dict has every key of the model's `state_dict()` (a tied head is the embedding itself).

    Raises:
        BatchpilotError: for another architecture, a feature batchpilot's Llama lacks, or weights that are
            missing or left over.
    """
    args = llama_args_from_hf_config(hf_config)
    inverse = llama_weight_names(args)
    state: dict[str, Tensor] = {}
    for theirs, tensor in hf_state_dict.items():
        if theirs.endswith("rotary_emb.inv_freq"):  # older exports saved the rotary table; it is derived
            continue
        if theirs == "lm_head.weight" and args["tie_embeddings"]:
            continue  # checked below against the embedding
        if theirs not in inverse:
            raise BatchpilotError(
                "weights", f"hold {theirs}, which a LlamaForCausalLM of this config.json does not have"
            )
        state[inverse[theirs]] = tensor
    missing = [theirs for theirs, ours in inverse.items() if ours not in state]
    if missing:
        raise BatchpilotError(
            "weights", f"lack {missing[0]}, a weight of this config.json's LlamaForCausalLM"
        )
    if args["tie_embeddings"]:
        if "lm_head.weight" in hf_state_dict:
            check_tied(
                {"lm_head.weight": hf_state_dict["lm_head.weight"], "e": state["tok_embeddings.weight"]},
                head="lm_head.weight",
                embedding="e",
            )
        state["output.weight"] = state["tok_embeddings.weight"]
    return LLAMA_FACTORY, args, state


# --- files ---------------------------------------------------------------------------------------------------


def read_hf_config(path: Path) -> Any:
    """The JSON of a checkpoint's config.json at `path`; a missing or unreadable file is one line naming it."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise BatchpilotError(str(path), f"is not readable JSON ({error})") from None


def read_hf_checkpoint(folder: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """config.json and the weights (`model.safetensors`, or the shards `model.safetensors.index.json` names)
    of a Hugging Face checkpoint folder, on CPU.

    Raises:
        BatchpilotError: for a missing or unreadable file, or weights only in the pickle format.
    """
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise BatchpilotError(str(config_path), "does not exist", "give a Hugging Face checkpoint folder")
    hf_config = read_hf_config(config_path)
    if (folder / WEIGHTS_FILE).is_file():
        files = [folder / WEIGHTS_FILE]
    elif (folder / INDEX_FILE).is_file():
        files = _index_files(folder)
    elif (folder / "pytorch_model.bin").is_file() or (folder / "pytorch_model.bin.index.json").is_file():
        raise BatchpilotError(
            str(folder),
            "holds its weights as pytorch_model.bin (a pickle), which batchpilot does not load",
            "save them as safetensors: model.save_pretrained(folder, safe_serialization=True)",
        )
    else:
        raise BatchpilotError(str(folder), f"has neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    safetensors_torch = require("safetensors.torch")
    state: dict[str, Tensor] = {}
    for path in files:
        try:
            state.update(safetensors_torch.load_file(str(path), device="cpu"))
        except Exception as error:  # safetensors raises its own error types for damaged files
            raise BatchpilotError(str(path), f"is not a readable safetensors file ({error})") from None
    return hf_config, state


def _index_files(folder: Path) -> list[Path]:
    index_path = folder / INDEX_FILE
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise BatchpilotError(str(index_path), f"is not a safetensors index ({error!r})") from None
    files = [folder / name for name in sorted(set(weight_map.values()))]
    missing = [path for path in files if not path.is_file()]
    if missing:
        raise BatchpilotError(str(missing[0]), f"is named by {INDEX_FILE} but does not exist")
    return files


class HfWeights(Protocol):
    """The weights `write_hf_checkpoint` writes, shard by shard: their sizes in the order written, and the
    tensors of one shard when it is written (so a 70B model need never be in memory whole)."""

    def sizes(self) -> dict[str, int]:
        """Hugging Face name -> bytes in the file, in the order written."""
        ...

    def load(self, names: list[str]) -> dict[str, Tensor]:
        """The tensors of `names`, as written (converted, in the file's dtype)."""
        ...


@dataclass(frozen=True)
class InMemory:
    """Weights already in memory (a state dict under Hugging Face names)."""

    state: Mapping[str, Tensor]

    def sizes(self) -> dict[str, int]:
        return {name: _num_bytes(tensor) for name, tensor in self.state.items()}

    def load(self, names: list[str]) -> dict[str, Tensor]:
        return {name: self.state[name] for name in names}


def write_hf_checkpoint(
    folder: Path,
    hf_config: dict[str, Any],
    weights: Mapping[str, Tensor] | HfWeights,
    *,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer_files: dict[str, bytes] | None = None,
) -> list[Path]:
    """Writes a Hugging Face checkpoint into `folder` (created if missing): config.json, the weights as
    `model.safetensors` or, over `max_shard_bytes`, as `model-0000K-of-0000N.safetensors` shards with
    `model.safetensors.index.json`, generation_config.json when the config names an EOS token, and
    `tokenizer_files` (name -> content). `weights` is a state dict under Hugging Face names, or `HfWeights`
    loaded one shard at a time. Returns the paths written, in that order.
    """
    safetensors_torch = require("safetensors.torch")
    source = InMemory(weights) if isinstance(weights, Mapping) else weights
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / CONFIG_FILE]
    written[0].write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    sizes = source.sizes()
    shards = _shards(sizes, max_shard_bytes=max_shard_bytes)
    names = (
        [WEIGHTS_FILE]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    for name, shard in zip(names, shards, strict=True):
        # safetensors refuses views of shared storage; each tensor gets its own contiguous copy.
        tensors = {key: tensor.detach().contiguous().clone() for key, tensor in source.load(shard).items()}
        safetensors_torch.save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors  # one shard in memory at a time
        weight_map.update(dict.fromkeys(shard, name))
        written.append(folder / name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(sizes.values())},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        written.append(folder / INDEX_FILE)
    if hf_config.get("eos_token_id") is not None:
        generation = {key: hf_config.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (folder / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
        written.append(folder / GENERATION_CONFIG_FILE)
    for name, data in (tokenizer_files or {}).items():
        (folder / name).write_bytes(data)
        written.append(folder / name)
    return written


def _num_bytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _shards(sizes: Mapping[str, int], *, max_shard_bytes: int) -> list[list[str]]:
    """The tensors' names in order, a new shard whenever the next would take the current one past the limit
    (a tensor larger than the limit gets a shard of its own)."""
    if max_shard_bytes <= 0:
        raise BatchpilotError("max_shard_bytes", f"must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


INIT_FROM_FIELD = "train.init_from"

HF_CONFIG_KEYS = {
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_kv_head": "num_key_value_heads",
    "n_embd": "hidden_size",
    "vocab_size": "vocab_size",
    "ffn_hidden_size": "intermediate_size",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
}
"""The Llama args a checkpoint fixes, with the config.json key that holds each (for the error lines).
`max_seq_len` is not among them: it only sizes the rotary tables, whose rows do not depend on it."""


def llama_shape_problems(
    *, model_factory: str, model_args: Mapping[str, Any], seq_len: int, hf_config: Any, path: Path | str
) -> list[BatchpilotError]:
    """A config.json (`path`, for the messages) against a config's model (`model.factory`, `model.args`):
    another architecture, or each Llama arg that differs, one error each (naming `train.init_from` or the
    arg); and model.args.max_seq_len below `seq_len` (data.seq_len). Torch-free: the plan's checks and the
    trainer both ask it."""
    from batchpilot.models.llama_config import LlamaConfig

    if not isinstance(hf_config, dict):
        return [BatchpilotError(INIT_FROM_FIELD, f"{path} holds no JSON object")]
    try:
        theirs = llama_args_from_hf_config(hf_config)
    except BatchpilotError as error:
        fix = error.fix or "give a LlamaForCausalLM checkpoint (other architectures are not read)"
        return [BatchpilotError(INIT_FROM_FIELD, f"{path} {error.problem}", fix)]
    try:
        ours = LlamaConfig(**model_args)
    except (TypeError, ValueError) as error:
        return [BatchpilotError("model.args", f"{model_factory} rejected its arguments: {error}")]
    problems = []
    for arg, key in HF_CONFIG_KEYS.items():
        value = ours.resolved_ffn_hidden_size if arg == "ffn_hidden_size" else getattr(ours, arg)
        if value != theirs[arg]:
            problems.append(
                BatchpilotError(
                    f"model.args.{arg}",
                    f"is {_yaml(value)} but {path} has {key} {_yaml(theirs[arg])}",
                    f"set model.args.{arg}: {_yaml(theirs[arg])}",
                )
            )
    if ours.max_seq_len < seq_len:
        problems.append(
            BatchpilotError(
                "model.args.max_seq_len",
                f"is {ours.max_seq_len}, shorter than data.seq_len {seq_len}",
                f"set model.args.max_seq_len: {max(seq_len, theirs['max_seq_len'])}",
            )
        )
    return problems


def _yaml(value: object) -> str:
    """A value as the config's YAML writes it (true, not True)."""
    return json.dumps(value)
