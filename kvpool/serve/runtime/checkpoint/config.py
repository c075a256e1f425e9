"""A Hugging Face Llama-family checkpoint directory, read and checked before any worker starts.

``read_checkpoint(path)`` reads ``config.json`` (and ``generation_config.json``
for EOS ids), finds the safetensors shards (``model.safetensors`` or the
``model.safetensors.index.json`` weight map) and checks that every tensor the
model needs is there with the right shape, opens ``tokenizer.json`` and checks
its vocabulary fits the embedding. Anything it cannot serve exactly raises
``CheckpointError`` naming the file or config field, so ``kvpool serve``
fails at start-up instead of serving wrong tokens.

Supported: ``model_type`` ``llama`` (incl. ``rope_scaling`` ``linear`` and
``llama3``, ``attention_bias``, ``tie_word_embeddings``), ``mistral``
(without a sliding window shorter than the context) and ``qwen2`` (bias on
q/k/v, without sliding-window layers).

The pool namespace: ``ModelConfig.name`` is ``hf/<dir name>/<digest>``, where
the digest covers ``config.json`` and the weights' identity (``identity``), so
two checkpoints never share KV even when their shapes agree.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field, replace
from typing import Any

from kvpool.serve.runtime.checkpoint.chat import ChatTemplate
from kvpool.serve.runtime.checkpoint.errors import CheckpointError
from kvpool.serve.runtime.checkpoint.hf_tokenizer import check_tokenizer
from kvpool.serve.runtime.checkpoint.identity import weights_digest
from kvpool.serve.runtime.checkpoint.weights import check_tensors, find_shards
from kvpool.serve.sched.presets import ModelConfig

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


@dataclass(frozen=True)
class RopeScaling:
    """``rope_scaling`` of config.json: ``linear`` or ``llama3`` (the others are refused)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class Checkpoint:
    """What the model code needs beyond ``ModelConfig``'s geometry."""

    path: pathlib.Path
    model: ModelConfig
    model_type: str
    qkv_bias: bool
    o_bias: bool
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None
    bos_id: int | None
    eos_ids: tuple[int, ...]
    shards: dict[str, str] = field(repr=False)  # tensor name -> shard file name
    digest: str = ""

    @property
    def eos_id(self) -> int | None:
        """The EOS id the decode workers stop at (the first of the checkpoint's)."""
        return self.eos_ids[0] if self.eos_ids else None


def is_checkpoint_path(spec: str) -> bool:
    """True if ``--model`` names a directory (a checkpoint) rather than a preset (a
    preset's name wins over a same-named directory unless written as a path)."""
    from kvpool.serve.sched.presets import PRESETS

    if "/" in spec or spec.startswith("."):
        return True
    return spec not in PRESETS and pathlib.Path(spec).is_dir()


def resolve_model(
    spec: str, *, block_tokens: int | None = None, dtype: str | None = None
) -> tuple[ModelConfig, Checkpoint | None]:
    """``--model``: a preset name, or a checkpoint directory (read and checked);
    ``dtype`` overrides the compute and KV dtype (so the KV layout follows)."""
    from kvpool.serve.sched.presets import get_preset

    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose from {', '.join(_DTYPES)}")
    if is_checkpoint_path(spec):
        ckpt = read_checkpoint(spec, block_tokens=block_tokens, dtype=dtype)
        return ckpt.model, ckpt
    cfg = get_preset(spec, block_tokens=block_tokens)
    return (cfg if dtype is None else replace(cfg, dtype=dtype)), None


def _read_json(path: pathlib.Path, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path} is missing: not a Hugging Face checkpoint directory")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return data


def _field(cfg: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = cfg.get(name, default)
    if value is None or isinstance(value, bool) or not isinstance(value, kind | int):
        raise CheckpointError(f"config.json field {name!r} is missing or not a {kind.__name__}")
    return value


def _rope_scaling(cfg: dict[str, Any]) -> RopeScaling | None:
    rs = cfg.get("rope_scaling")
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise CheckpointError("config.json field 'rope_scaling' is not an object")
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise CheckpointError(
            f"config.json field 'rope_scaling' of type {kind!r} is not implemented "
            "(supported: linear, llama3)"
        )
    try:
        return RopeScaling(
            kind=kind,
            factor=float(rs["factor"]),
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"config.json field 'rope_scaling' is incomplete: {exc}") from None


def _check_unsupported(cfg: dict[str, Any], model_type: str, max_pos: int) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config.json field 'hidden_act' {act!r} is not implemented (silu)")
    if cfg.get("mlp_bias"):
        raise CheckpointError("config.json field 'mlp_bias' true is not implemented")
    hidden, heads, head_dim = (
        cfg.get(k) for k in ("hidden_size", "num_attention_heads", "head_dim")
    )
    if (
        head_dim is not None
        and isinstance(hidden, int)
        and isinstance(heads, int)
        and heads
        and (head_dim != hidden // heads)
    ):
        raise CheckpointError(
            f"config.json field 'head_dim' {head_dim} != hidden_size / num_attention_heads "
            "is not implemented"
        )
    if cfg.get("pretraining_tp", 1) != 1:
        raise CheckpointError("config.json field 'pretraining_tp' != 1 is not implemented")
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", model_type == "mistral")
    if uses_window and window is not None and window < max_pos:
        raise CheckpointError(
            f"config.json field 'sliding_window' {window} (< the context {max_pos}) "
            "is not implemented"
        )


def _eos_ids(path: pathlib.Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    gen = _read_json(path / "generation_config.json", required=False)
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) for i in ids):
        raise CheckpointError(f"eos_token_id {eos!r} is not an id or a list of ids")
    return tuple(ids)


def read_checkpoint(
    spec: str | pathlib.Path, *, block_tokens: int | None = None, dtype: str | None = None
) -> Checkpoint:
    """The checkpoint in directory ``spec``, checked (CheckpointError says what is wrong)."""
    path = pathlib.Path(spec)
    if not path.is_dir():
        raise CheckpointError(f"--model {spec}: no such directory (and not a preset name)")
    cfg = _read_json(path / "config.json")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"config.json field 'model_type' {model_type!r} is not implemented "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    max_pos = _field(cfg, "max_position_embeddings", int)
    _check_unsupported(cfg, model_type, max_pos)
    torch_dtype = cfg.get("torch_dtype", cfg.get("dtype", "float32"))
    if dtype is None:
        if torch_dtype not in _DTYPES:
            raise CheckpointError(f"config.json field 'torch_dtype' {torch_dtype!r} is unknown")
        dtype = _DTYPES[torch_dtype]
    hidden = _field(cfg, "hidden_size", int)
    heads = _field(cfg, "num_attention_heads", int)
    try:
        model = ModelConfig(
            name="",
            num_layers=_field(cfg, "num_hidden_layers", int),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=_field(cfg, "num_key_value_heads", int, heads),
            intermediate_size=_field(cfg, "intermediate_size", int),
            vocab_size=_field(cfg, "vocab_size", int),
            max_context=max_pos,
            dtype=dtype,
            block_tokens=block_tokens or 512,
            rope_theta=float(_field(cfg, "rope_theta", float, 10000.0)),
            norm_eps=float(_field(cfg, "rms_norm_eps", float, 1e-6)),
        )
    except ValueError as exc:
        raise CheckpointError(f"config.json: {exc}") from None
    qkv_bias = model_type == "qwen2" or bool(cfg.get("attention_bias", False))
    o_bias = model_type != "qwen2" and bool(cfg.get("attention_bias", False))
    tie = bool(cfg.get("tie_word_embeddings", False))  # the three configs' default
    shards = find_shards(path)
    check_tensors(path, shards, model, qkv_bias=qkv_bias, o_bias=o_bias, tied=tie)
    digest = weights_digest(path, sorted(set(shards.values())))
    name = f"hf/{path.resolve().name}/{digest[:16]}"
    model = replace(model, name=name)
    bos = cfg.get("bos_token_id")
    ckpt = Checkpoint(
        path=path,
        model=model,
        model_type=model_type,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        tie_word_embeddings=tie,
        rope_scaling=_rope_scaling(cfg),
        bos_id=bos if isinstance(bos, int) else None,
        eos_ids=_eos_ids(path, cfg),
        shards=shards,
        digest=digest,
    )
    check_tokenizer(ckpt)
    ChatTemplate.load(path)  # a template that does not compile fails now, not per request
    return ckpt
