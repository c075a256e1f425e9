"""A tiny random Llama checkpoint in the Hugging Face format, written without ``transformers``.

For the benchmarks (``kvpool bench serve --checkpoint``, the GPU check): they
need one model that ``kvpool serve``, ``transformers`` and vLLM all load, on
machines where ``transformers`` may be absent (the GPU machine gets only
kvpool's runtime wheels). So the files are written directly, with the
libraries kvpool serve itself reads them with:

- ``config.json``: ``LlamaForCausalLM`` (``model_type`` llama, silu, no
  biases, untied head unless ``tie``);
- ``model.safetensors`` (``safetensors.torch.save_file``): the Llama tensor
  names and shapes, random weights from a seeded generator (normal 0.2 for
  matrices, 1 + normal 0.05 for norms: logits that are not all alike);
- ``tokenizer.json`` (``tokenizers``): byte-level BPE without merges (256
  byte tokens after ``<s>`` = 0 and ``</s>`` = 1; every text encodes), BOS
  added by its post-processor; ``tokenizer_config.json`` and
  ``special_tokens_map.json`` so ``transformers``' ``AutoTokenizer`` (and so
  vLLM) load it as a fast tokenizer.

tests/test_serve_bench_checkpoint.py checks that ``transformers`` loads what
this writes and computes the same logits as kvpool's runtime.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

VOCAB = 272  # 2 specials + 256 bytes, rounded up to a multiple of 16


@dataclass(frozen=True)
class TinyShape:
    """The model's sizes (head_dim 32: vLLM's CPU attention needs >= 32)."""

    layers: int = 4
    hidden: int = 128
    intermediate: int = 256
    heads: int = 4
    kv_heads: int = 2
    vocab: int = VOCAB
    max_positions: int = 4096


def _tensors(shape: TinyShape, tie: bool, seed: int, dtype: str) -> dict[str, object]:
    import torch

    g = torch.Generator().manual_seed(seed)
    hd = shape.hidden // shape.heads
    h, i = shape.hidden, shape.intermediate

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * 0.2

    def norm() -> torch.Tensor:
        return 1.0 + torch.randn(h, generator=g) * 0.05

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": mat(shape.vocab, h)}
    for n in range(shape.layers):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = norm()
        out[p + "self_attn.q_proj.weight"] = mat(shape.heads * hd, h)
        out[p + "self_attn.k_proj.weight"] = mat(shape.kv_heads * hd, h)
        out[p + "self_attn.v_proj.weight"] = mat(shape.kv_heads * hd, h)
        out[p + "self_attn.o_proj.weight"] = mat(h, shape.heads * hd)
        out[p + "post_attention_layernorm.weight"] = norm()
        out[p + "mlp.gate_proj.weight"] = mat(i, h)
        out[p + "mlp.up_proj.weight"] = mat(i, h)
        out[p + "mlp.down_proj.weight"] = mat(h, i)
    out["model.norm.weight"] = norm()
    if not tie:
        out["lm_head.weight"] = mat(shape.vocab, h)
    to = getattr(torch, dtype)
    return {k: v.to(to).contiguous() for k, v in out.items()}


def byte_bpe_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: ``<s>`` = 0, ``</s>`` = 1, then the 256
    byte tokens; BOS added by the post-processor (tests/hf_checkpoints.py wraps
    the same tokenizer for ``transformers``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1} | {ch: n + 2 for n, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def _tokenizer(path: pathlib.Path) -> None:
    tok = byte_bpe_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    (path / "special_tokens_map.json").write_text(json.dumps(special))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "add_bos_token": False,  # the post-processor adds it
        **special,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def write_tiny_checkpoint(
    path: pathlib.Path | str,
    *,
    shape: TinyShape = TinyShape(),
    tie: bool = False,
    seed: int = 0,
    dtype: str = "float32",
) -> pathlib.Path:
    """Write the checkpoint into directory ``path`` (created); returns it."""
    from safetensors.torch import save_file

    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype {dtype!r}: float32, float16 or bfloat16")
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise ValueError(f"{shape}: hidden must divide into heads, heads into kv_heads")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(_tensors(shape, tie, seed, dtype), str(path / "model.safetensors"))  # type: ignore[arg-type]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden // shape.heads,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": dtype,
        "kvpool_tiny": asdict(shape),
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    _tokenizer(path)
    return path
