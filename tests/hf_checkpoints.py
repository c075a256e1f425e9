"""Tiny Hugging Face checkpoints built locally with ``transformers`` (fixed seed) for tests."""

from __future__ import annotations

import pathlib
from typing import Any

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_tokenizer(chat_template: str | None = None) -> Any:
    """A byte-level BPE tokenizer (no merges) with ``<s>``/``</s>`` and BOS added."""
    from transformers import PreTrainedTokenizerFast

    from kvpool.bench.tiny_checkpoint import byte_bpe_tokenizer

    tok = byte_bpe_tokenizer()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=chat_template
    )


def make_checkpoint(
    path: pathlib.Path,
    *,
    kind: str = "llama",
    tie: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
    layers: int = 2,
    chat_template: str | None = None,
    dtype: str = "float32",
    max_shard_size: str | None = None,
) -> pathlib.Path:
    """A random-init checkpoint of ``kind`` (llama, qwen2) with its tokenizer, in ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=272,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype=dtype,
    )
    if kind == "llama":
        cfg: Any = LlamaConfig(rope_scaling=rope_scaling, **common)
    else:
        cfg = Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=getattr(torch, dtype))
    with torch.no_grad():  # default init is tiny: widen it so logits are not all alike
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() == 2 else 0.05).add_(1.0 if p.dim() == 1 else 0.0)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    if max_shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    byte_tokenizer(chat_template).save_pretrained(path)
    return path
