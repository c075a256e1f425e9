"""How vLLM's paged KV cache maps onto kvpool blocks, and the keys of a request.

A kvpool block holds ``block_tokens`` (512 by default) prompt tokens, i.e.
``pages_per_block = block_tokens / block_size`` vLLM blocks. Its bytes are laid
out layer-major: for each layer, the pages of its vLLM blocks in token order::

    [layer 0: page 0 | page 1 | ... ][layer 1: page 0 | ... ] ...

so one layer of one kvpool block is one contiguous range (``layer_offset``),
written by ``save_kv_layer`` as soon as that layer's attention ran, and a
local hit that ends inside a kvpool block reads only its remaining pages.
Pages are opaque bytes: whatever vLLM's attention backend keeps for one
(layer, vLLM block), e.g. on the CPU backend ``[kv_heads, block_size,
2*head_size]`` with K transposed inside; on GPU backends K and V halves
elsewhere. Their size comes from the KV cache spec, their addresses from the
registered tensors (``bindings/vllm/pages.py``).

Keys: ``kvpool.block_keys`` over the prompt token ids, in a namespace made of
the model (``model_id``, by default its name plus a digest of its config),
the page format (backend platform, spec, dtype, block sizes, layer count), the
tensor-parallel rank and size, and per request the ``cache_salt`` and LoRA
adapter. The same prompt gets the same keys in every process and restart
(vLLM's own block hashes are seeded randomly unless PYTHONHASHSEED is set).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.index.keys import DEFAULT_BLOCK_TOKENS, Namespace, block_keys

# hf config fields that name the install, not the model
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_commit_hash", "_name_or_path"}


@dataclass(frozen=True)
class Geometry:
    """Sizes shared by the scheduler and the workers (plain data: it is pickled)."""

    num_layers: int
    block_size: int  # tokens per vLLM block
    block_tokens: int  # tokens per kvpool block
    page_bytes: int  # bytes of one (layer, vLLM block) page
    tp_size: int
    model_id: str
    page_format: str  # the namespace's layout descriptor

    def __post_init__(self) -> None:
        if self.block_tokens % self.block_size:
            raise ValueError(
                f"kvpool block_tokens ({self.block_tokens}) must be a multiple of vLLM's "
                f"block_size ({self.block_size})"
            )

    @property
    def pages_per_block(self) -> int:
        return self.block_tokens // self.block_size

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of one kvpool block."""
        return self.pages_per_block * self.page_bytes

    @property
    def pool_block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def layer_offset(self, layer: int, first_page: int = 0) -> int:
        """Offset of ``first_page`` of ``layer`` inside a kvpool block."""
        return layer * self.layer_bytes + first_page * self.page_bytes

    def namespace(self, tp_rank: int, tenant: str | None) -> Namespace:
        return Namespace(
            model=self.model_id,
            layout=self.page_format,
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            tenant=tenant,
        )

    def keys(self, token_ids: Sequence[int], tenant: str | None) -> list[list[bytes]]:
        """Keys of every full kvpool block of ``token_ids``, one list per TP rank."""
        return [
            block_keys(token_ids, self.namespace(rank, tenant), self.block_tokens)
            for rank in range(self.tp_size)
        ]


def geometry_from_vllm(vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any]) -> Geometry:
    """The geometry of this engine's KV cache; ValueError where kvpool cannot serve it."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise ValueError(
            f"KVPoolConnector supports models with one KV cache group, this one has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    block_tokens = extra.get("block_tokens", DEFAULT_BLOCK_TOKENS)
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ValueError(
            f"KVPoolConnector: block_tokens must be a positive int, not {block_tokens!r}"
        )
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    num_layers = len(groups[0].layer_names)
    from vllm.platforms import current_platform

    fields = {
        "platform": str(current_platform.device_type),
        "spec": type(spec).__name__,
        "heads": getattr(spec, "num_kv_heads", None),
        "head_size": getattr(spec, "head_size", None),
        "dtype": str(getattr(spec, "dtype", "")),
        "page_bytes": int(spec.page_size_bytes),
        "block_size": int(spec.block_size),
        "layers": num_layers,
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
    }
    page_format = "vllm:" + json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return Geometry(
        num_layers=num_layers,
        block_size=int(spec.block_size),
        block_tokens=block_tokens,
        page_bytes=int(spec.page_size_bytes),
        tp_size=tp_size,
        model_id=str(extra.get("model_id") or default_model_id(vllm_config.model_config)),
        page_format=page_format,
    )


def default_model_id(model_config: Any) -> str:
    """``NAME@REVISION#DIGEST``: the model as vLLM names it, plus a digest of its config.

    The name is the path or hub id given to vLLM; processes that load the same
    weights from different paths share KV only with an explicit ``model_id``.
    """
    hf = model_config.hf_config.to_dict()
    config = {k: v for k, v in hf.items() if k not in _VOLATILE_CONFIG_KEYS}
    text = json.dumps(config, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{model_config.model}@{model_config.revision or ''}#{digest}"


def request_tenant(request: Any) -> str | None:
    """The per-request part of the namespace: ``cache_salt`` and LoRA adapter."""
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_request", None)
    lora_name = getattr(lora, "lora_name", None) if lora is not None else None
    if salt is None and lora_name is None:
        return None
    return json.dumps({"salt": salt, "lora": lora_name}, sort_keys=True)
