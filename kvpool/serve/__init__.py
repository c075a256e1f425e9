"""Reference serving runtime: a LLaMA-architecture model, prefill and decode workers.

- ``presets``: model shapes (``tiny``, ``llama2-7b``, ``llama2-70b``) with KV
  layouts, namespaces and analytic FLOPs/bytes per token;
- ``model``: the decoder (deterministic random weights) and the reference
  ``generate``;
- ``prefill``: ``PrefillWorker`` (cached prefix from the pool, chunked
  compute, layer-wise store);
- ``decode``: ``DecodeEngine`` (paged KV memory, continuous batching);
- ``tokenizer``: byte-level tokenizer.
"""

from kvpool.serve.decode import DecodeEngine, DecodeRequest, PagedKVCache, TokenEvent
from kvpool.serve.model import Transformer, build_model, generate
from kvpool.serve.prefill import PrefillResult, PrefillWorker
from kvpool.serve.presets import PRESETS, ModelConfig, get_preset
from kvpool.serve.tokenizer import ByteTokenizer

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
