"""Reference serving runtime: a LLaMA-architecture model, prefill and decode workers.

- ``presets``: model shapes (``tiny``, ``llama2-7b``, ``llama2-70b``) with KV
  layouts, namespaces and analytic FLOPs/bytes per token (no torch import, so
  the simulator and conductor can use it cheaply);
- ``model``: the decoder (deterministic random weights) and the reference
  ``generate``;
- ``prefill``: ``PrefillWorker`` (cached prefix from the pool, chunked
  compute, layer-wise store);
- ``decode``: ``DecodeEngine`` (paged KV memory, continuous batching);
- ``kv_io``: per-layer KV between torch tensors and the pool;
- ``tokenizer``: byte-level tokenizer.

The names below are imported lazily: ``import kvpool.serve`` alone does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.serve.decode import DecodeEngine, DecodeRequest, PagedKVCache, TokenEvent
    from kvpool.serve.model import Transformer, build_model, generate
    from kvpool.serve.prefill import PrefillResult, PrefillWorker
    from kvpool.serve.presets import PRESETS, ModelConfig, get_preset
    from kvpool.serve.tokenizer import ByteTokenizer

_HOME = {
    "DecodeEngine": "decode",
    "DecodeRequest": "decode",
    "PagedKVCache": "decode",
    "TokenEvent": "decode",
    "Transformer": "model",
    "build_model": "model",
    "generate": "model",
    "PrefillResult": "prefill",
    "PrefillWorker": "prefill",
    "PRESETS": "presets",
    "ModelConfig": "presets",
    "get_preset": "presets",
    "ByteTokenizer": "tokenizer",
}

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "DecodeEngine",
    "DecodeRequest",
    "ModelConfig",
    "PagedKVCache",
    "PrefillResult",
    "PrefillWorker",
    "TokenEvent",
    "Transformer",
    "build_model",
    "generate",
    "get_preset",
]


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool.serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvpool.serve.{module}"), name)
    globals()[name] = value
    return value
