"""Reference serving runtime (``runtime/``, torch) and scheduler (``sched/``, torch-free).

- ``sched.presets``: model shapes (``tiny``, ``llama2-7b``, ``llama2-70b``) with KV
  layouts, namespaces and analytic FLOPs/bytes per token (no torch import, so
  the simulator and conductor can use it cheaply);
- ``runtime.model``: the decoder (deterministic random weights) and the reference
  ``generate``;
- ``runtime.prefill``: ``PrefillWorker`` (cached prefix from the pool, chunked
  compute, layer-wise store);
- ``runtime.decode``: ``DecodeEngine`` (paged KV memory, continuous batching);
- ``runtime.kv_io``: per-layer KV between torch tensors and the pool;
- ``runtime.tokenizer``: byte-level tokenizer;
- ``runtime.checkpoint``: Hugging Face Llama-family checkpoints (``--model PATH``).

The names below are imported lazily: ``import kvpool.serve`` alone does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.serve.runtime.decode import DecodeEngine, DecodeRequest, PagedKVCache, TokenEvent
    from kvpool.serve.runtime.model import Transformer, build_model, generate
    from kvpool.serve.runtime.prefill import PrefillResult, PrefillWorker
    from kvpool.serve.runtime.tokenizer import ByteTokenizer
    from kvpool.serve.sched.presets import PRESETS, ModelConfig, get_preset

_HOME = {
    "DecodeEngine": "runtime.decode",
    "DecodeRequest": "runtime.decode",
    "PagedKVCache": "runtime.decode",
    "TokenEvent": "runtime.decode",
    "Transformer": "runtime.model",
    "build_model": "runtime.model",
    "generate": "runtime.model",
    "PrefillResult": "runtime.prefill",
    "PrefillWorker": "runtime.prefill",
    "PRESETS": "sched.presets",
    "ModelConfig": "sched.presets",
    "get_preset": "sched.presets",
    "ByteTokenizer": "runtime.tokenizer",
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
