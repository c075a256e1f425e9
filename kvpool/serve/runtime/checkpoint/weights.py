"""Safetensors shards: where each tensor is, their checks, and loading a model's own layers.

Shards are opened with ``safetensors.safe_open`` (memory-mapped): a worker
reads only the tensors of the layers it holds (``hf_name`` maps the model's
parameter names to the checkpoint's), so a pipeline stage never reads the
other stages' layers. A tied LM head (``tie_word_embeddings``) is loaded
from the embedding.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from kvpool.serve.runtime.checkpoint.errors import CheckpointError
from kvpool.serve.sched.presets import ModelConfig

if TYPE_CHECKING:
    from torch import nn

    from kvpool.serve.runtime.checkpoint.config import Checkpoint

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


def hf_name(name: str) -> str:
    """The checkpoint's tensor name of our parameter ``name`` (``layers.3.q_proj.weight``)."""
    if name.startswith("layers."):
        _, idx, part, kind = name.split(".")
        return f"model.layers.{idx}.{_LAYER_PARTS[part]}.{kind}"
    if name == "lm_head.weight":
        return name
    return f"model.{name}"


def find_shards(path: pathlib.Path) -> dict[str, str]:
    """Tensor name -> shard file, from the index or the single file's header."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} has no valid 'weight_map': {exc}") from None
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise CheckpointError(f"shard {shard} named by {INDEX} is missing from {path}")
        return dict(weight_map)
    single = path / SINGLE
    if not single.is_file():
        raise CheckpointError(
            f"{path} has neither {SINGLE} nor {INDEX} (only safetensors checkpoints are supported)"
        )
    from safetensors import safe_open

    try:
        with safe_open(str(single), framework="pt") as f:
            return {k: SINGLE for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    except Exception as exc:
        raise CheckpointError(f"{single} is not a readable safetensors file: {exc}") from None


def expected_shapes(
    cfg: ModelConfig, *, qkv_bias: bool, o_bias: bool, tied: bool
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor the model needs (checkpoint names) and its shape."""
    h, kv, inter, v = cfg.hidden_size, cfg.kv_dim, cfg.intermediate_size, cfg.vocab_size
    yield "model.embed_tokens.weight", (v, h)
    yield "model.norm.weight", (h,)
    if not tied:
        yield "lm_head.weight", (v, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        for name, shape in (("q", h), ("k", kv), ("v", kv)):
            yield p + f"self_attn.{name}_proj.weight", (shape, h)
            if qkv_bias:
                yield p + f"self_attn.{name}_proj.bias", (shape,)
        yield p + "self_attn.o_proj.weight", (h, h)
        if o_bias:
            yield p + "self_attn.o_proj.bias", (h,)
        yield p + "mlp.gate_proj.weight", (inter, h)
        yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)


def check_tensors(
    path: pathlib.Path,
    shards: dict[str, str],
    cfg: ModelConfig,
    *,
    qkv_bias: bool,
    o_bias: bool,
    tied: bool,
) -> None:
    """Every needed tensor is present with its shape (reads headers only)."""
    from safetensors import safe_open

    expected = dict(expected_shapes(cfg, qkv_bias=qkv_bias, o_bias=o_bias, tied=tied))
    missing = sorted(n for n in expected if n not in shards)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{path}: tensors missing from the checkpoint: {missing[:3]}{more}")
    for shard in sorted(set(shards[n] for n in expected)):
        try:
            with safe_open(str(path / shard), framework="pt") as f:
                names = set(f.keys())
                for n, shape in expected.items():
                    if shards[n] != shard:
                        continue
                    if n not in names:
                        raise CheckpointError(f"{shard} lacks tensor {n} that {INDEX} places there")
                    got = tuple(f.get_slice(n).get_shape())
                    if got != shape:
                        raise CheckpointError(
                            f"{shard}: {n} has shape {got}, config.json implies {shape}"
                        )
        except OSError as exc:
            raise CheckpointError(f"{path / shard} is not readable: {exc}") from None


def load_weights(model: nn.Module, ckpt: Checkpoint, names: Iterable[str]) -> None:
    """Copy the checkpoint's tensors into ``model``'s parameters ``names`` (cast to its dtype)."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    by_shard: dict[str, list[tuple[str, str]]] = {}
    for name in names:
        source = hf_name(name)
        if name == "lm_head.weight" and ckpt.tie_word_embeddings:
            source = "model.embed_tokens.weight"
        by_shard.setdefault(ckpt.shards[source], []).append((name, source))
    for shard, pairs in sorted(by_shard.items()):
        with safe_open(str(ckpt.path / shard), framework="pt", device="cpu") as f:
            for name, source in pairs:
                param = params[name]
                param.data.copy_(f.get_tensor(source).to(param.dtype))
