"""A LLaMA-architecture decoder: deterministic random weights, or a Hugging Face checkpoint.

RMSNorm, rotary position embeddings (rotate-half form), grouped-query
attention and a SwiGLU MLP. A preset's weights are random (the model exists
to measure serving); ``build_model(PATH)`` loads a Llama-family checkpoint
(``runtime.checkpoint``: q/k/v(/o) biases, tied LM head, scaled rotary
frequencies), computing exactly as ``transformers`` does.

Determinism: every weight tensor is drawn from its own generator seeded with
``xxh3_64(seed, tensor name)``, so the same preset and seed give bit-identical
weights in every process (on the same device type), in any construction
order, and a model holding only a range of layers (a pipeline stage) gets
exactly the full model's weights for them.

KV convention: per layer, K and V are ``[tokens, num_kv_heads, head_dim]``
tensors (K after rotary embedding), which is exactly one block's K or V in
``KVLayout``'s byte order when ``tokens == block_tokens``.

Two ways to run it:

- ``forward(tokens, past)``: the whole stack at once, returning logits for
  every new token and the new KV per layer (``on_layer`` sees each layer's
  KV as soon as it is computed).
- the explicit layer loop that the prefill worker uses so it can load a
  cached prefix and store new KV per layer::

      h = model.embed(tokens)
      for layer in range(cfg.num_layers):
          h = model.run_layer(layer, h, start, k_buf[layer], v_buf[layer])
      logits = model.logits(h)

  and, for batched decode, ``layer_qkv`` / ``attention`` / ``layer_out``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import cast

import torch
import torch.nn.functional as F
import xxhash
from torch import Tensor, nn

from kvpool.serve.runtime.checkpoint.config import (
    Checkpoint,
    RopeScaling,
    is_checkpoint_path,
    read_checkpoint,
)
from kvpool.serve.sched.presets import ModelConfig, get_preset

KV = tuple[Tensor, Tensor]
LayerHook = Callable[[int, Tensor, Tensor], None]

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"the model cannot compute in {name!r}") from None


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one named weight tensor (stable everywhere)."""
    return xxhash.xxh3_64_intdigest(f"kvpool-serve/{seed}/{name}".encode()) & ((1 << 63) - 1)


def scaled_inv_freq(inv_freq: Tensor, rs: RopeScaling | None) -> Tensor:
    """Rotary frequencies after ``rope_scaling`` (linear divides; llama3 is Meta's rule:
    long wavelengths divided by ``factor``, short kept, a smooth blend between), in
    float32 as ``transformers`` computes them."""
    if rs is None:
        return inv_freq
    if rs.kind == "linear":
        return inv_freq / rs.factor
    old = rs.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / rs.low_freq_factor, inv_freq / rs.factor, inv_freq)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < old / rs.high_freq_factor) & ~(wavelen > old / rs.low_freq_factor)
    return torch.where(medium, blended, scaled)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), False)

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        qkv_bias: bool = False,
        o_bias: bool = False,
    ) -> None:
        super().__init__()
        h, kv, inter = cfg.hidden_size, cfg.kv_dim, cfg.intermediate_size

        def linear(out_f: int, in_f: int, bias: bool = False) -> nn.Linear:
            return nn.Linear(in_f, out_f, bias=bias, dtype=dtype, device=device)

        self.attn_norm = RMSNorm(h, cfg.norm_eps, dtype, device)
        self.q_proj = linear(h, h, qkv_bias)
        self.k_proj = linear(kv, h, qkv_bias)
        self.v_proj = linear(kv, h, qkv_bias)
        self.o_proj = linear(h, h, o_bias)
        self.mlp_norm = RMSNorm(h, cfg.norm_eps, dtype, device)
        self.gate_proj = linear(inter, h)
        self.up_proj = linear(inter, h)
        self.down_proj = linear(h, inter)


class Transformer(nn.Module):
    """The decoder. ``dtype`` overrides the preset's (and so its KV layout);
    ``layers`` limits which layers exist (a pipeline stage); ``checkpoint``
    gives the architecture details and the weights (else random from ``seed``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        seed: int = 0,
        *,
        device: str | torch.device = "cpu",
        dtype: str | None = None,
        layers: Sequence[int] | None = None,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        super().__init__()
        if dtype is not None and dtype != cfg.dtype:
            cfg = replace(cfg, dtype=dtype)  # the KV layout and namespace follow the dtype
        self.cfg = cfg
        self.seed = seed
        self.device = torch.device(device)
        self.dtype = torch_dtype(cfg.dtype)
        self.layer_ids = list(range(cfg.num_layers) if layers is None else layers)
        for i in self.layer_ids:
            if not 0 <= i < cfg.num_layers:
                raise ValueError(f"layer {i} is outside [0, {cfg.num_layers})")
        # Built on the meta device (no memory, no default init), then materialised
        # once on the target device and filled by _init_weights.
        dt, dev, meta = self.dtype, self.device, torch.device("meta")
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dt, device=meta)
        self.checkpoint = ck = checkpoint
        bias = (ck.qkv_bias, ck.o_bias) if ck else (False, False)
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, dt, meta, *bias) for i in self.layer_ids}
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dt, meta)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dt, device=meta)
        self.to_empty(device=dev)
        half = cfg.head_dim // 2
        if ck is None:
            exponents = torch.arange(half, dtype=torch.float64) * 2 / cfg.head_dim
            self._inv_freq = (1.0 / (cfg.rope_theta**exponents)).to(dev)
        else:  # as transformers computes them: float32 frequencies and angles
            exponents32 = torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim
            base = 1.0 / (cfg.rope_theta**exponents32)
            self._inv_freq = scaled_inv_freq(base, ck.rope_scaling).to(dev)
        self._rope_len = 0
        self._cos = self._sin = torch.empty(0)
        if ck is None:
            self._init_weights()
        else:
            from kvpool.serve.runtime.checkpoint.weights import load_weights

            load_weights(self, ck, [n for n, _ in self.named_parameters()])
        self.requires_grad_(False)
        self.eval()

    # -- construction ----------------------------------------------------------

    def _init_weights(self) -> None:
        """Draw every weight from its own named, seeded generator."""
        cfg = self.cfg
        out_scale = 1.0 / math.sqrt(2 * cfg.num_layers)
        gen_device = "cuda" if self.device.type == "cuda" else "cpu"
        # Names carry the global layer index ("layers.7.q_proj.weight").
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.data.fill_(1.0)  # RMSNorm starts as the identity scale
                continue
            std = 1.0 if name == "embed_tokens.weight" else 1.0 / math.sqrt(param.shape[1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std *= out_scale
            gen = torch.Generator(device=gen_device).manual_seed(tensor_seed(self.seed, name))
            values = torch.randn(
                tuple(param.shape), generator=gen, dtype=torch.float32, device=gen_device
            )
            param.data.copy_((values * std).to(self.dtype))

    # -- the explicit layer loop -----------------------------------------------

    def layer(self, layer: int) -> DecoderLayer:
        """The module of global layer index ``layer`` (KeyError if this model lacks it)."""
        return cast(DecoderLayer, self.layers[str(layer)])

    def embed(self, tokens: Tensor) -> Tensor:
        """Hidden states ``[T, hidden]`` of token ids ``[T]``."""
        return self.embed_tokens(tokens.to(self.device))

    def logits(self, h: Tensor) -> Tensor:
        """Float32 logits ``[..., vocab]`` of hidden states ``[..., hidden]``."""
        return self.lm_head(self.norm(h)).float()

    def rope_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Float32 ``cos``, ``sin`` ``[..., T, 1, head_dim]`` of ``positions [..., T]``.

        Angles are computed once per position (in float64) into a cached
        table, so a position's rotation never depends on how tokens are batched.
        """
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self._rope_len:
            size = max(need, min(self.cfg.max_context, 4096), 2 * self._rope_len)
            dt = self._inv_freq.dtype  # float64 for presets, float32 (as HF) for checkpoints
            angles = torch.arange(size, dtype=dt, device=self.device)[:, None] * self._inv_freq
            self._cos = torch.cat([angles.cos(), angles.cos()], -1).float()
            self._sin = torch.cat([angles.sin(), angles.sin()], -1).float()
            self._rope_len = size
        idx = positions.to(self.device, torch.long)
        return self._cos[idx][..., None, :], self._sin[idx][..., None, :]

    def rope(self, x: Tensor, tables: tuple[Tensor, Tensor]) -> Tensor:
        """Rotate ``x [..., T, heads, head_dim]`` by ``rope_tables(positions)``."""
        cos, sin = tables
        if self.checkpoint is not None:  # as transformers: in the model's dtype
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
            half = x.shape[-1] // 2
            return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin
        x32 = x.float()
        half = x32.shape[-1] // 2
        rotated = torch.cat([-x32[..., half:], x32[..., :half]], -1)
        return (x32 * cos + rotated * sin).to(x.dtype)

    def layer_qkv(self, layer: int, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``[..., T, heads, hd]`` and the new K, V ``[..., T, kv_heads, hd]``."""
        cfg, mod = self.cfg, self.layer(layer)
        x = mod.attn_norm(h)
        shape = x.shape[:-1]
        q = mod.q_proj(x).view(*shape, cfg.num_heads, cfg.head_dim)
        k = mod.k_proj(x).view(*shape, cfg.num_kv_heads, cfg.head_dim)
        v = mod.v_proj(x).view(*shape, cfg.num_kv_heads, cfg.head_dim)
        tables = self.rope_tables(positions)
        return self.rope(q, tables), self.rope(k, tables), v

    def attention(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
        """Grouped-query attention, batch-first and token-major.

        ``q [B, Tq, heads, hd]``, ``k, v [B, Tk, kv_heads, hd]``, ``allowed``
        a bool mask ``[B, Tq, Tk]`` (True = may attend). Returns ``[B, Tq, hidden]``.
        """
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=allowed[:, None],
            enable_gqa=True,
        )
        return out.transpose(1, 2).reshape(*q.shape[:2], self.cfg.hidden_size)

    def layer_out(self, layer: int, h: Tensor, attn: Tensor) -> Tensor:
        """Residual + output projection, then the SwiGLU MLP block."""
        mod = self.layer(layer)
        h = h + mod.o_proj(attn)
        x = mod.mlp_norm(h)
        return h + mod.down_proj(F.silu(mod.gate_proj(x)) * mod.up_proj(x))

    def run_layer(self, layer: int, h: Tensor, start: int, k_buf: Tensor, v_buf: Tensor) -> Tensor:
        """One layer for tokens at positions ``[start, start + T)``, causally.

        ``k_buf``/``v_buf`` ``[>= start + T, kv_heads, hd]`` already hold this
        layer's KV of positions ``[0, start)``; the new tokens' KV is written
        into ``[start, start + T)`` and attention covers ``[0, start + T)``.
        """
        n = h.shape[0]
        end = start + n
        positions = torch.arange(start, end, device=self.device)
        q, k, v = self.layer_qkv(layer, h, positions)
        k_buf[start:end] = k
        v_buf[start:end] = v
        allowed = torch.arange(end, device=self.device)[None, :] <= positions[:, None]
        attn = self.attention(q[None], k_buf[None, :end], v_buf[None, :end], allowed[None])
        return self.layer_out(layer, h, attn[0])

    def kv_buffers(self, tokens: int) -> list[KV]:
        """Empty per-layer K, V buffers for ``tokens`` positions."""
        shape = (tokens, self.cfg.num_kv_heads, self.cfg.head_dim)
        return [
            (
                torch.empty(shape, dtype=self.dtype, device=self.device),
                torch.empty(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.cfg.num_layers)
        ]

    # -- whole forward ---------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor | Sequence[int],
        past: Sequence[KV] | None = None,
        *,
        on_layer: LayerHook | None = None,
    ) -> tuple[Tensor, list[KV]]:
        """Logits ``[T, vocab]`` (float32) of ``tokens`` after ``past``, and their KV per layer.

        ``past[l]`` is layer l's ``(K, V)`` of the preceding tokens (positions
        ``0..P-1``). ``on_layer(l, k, v)`` is called as soon as layer l's new
        KV exists. Needs every layer (not a pipeline stage).
        """
        if len(self.layer_ids) != self.cfg.num_layers:
            raise RuntimeError("forward() needs the whole model; this one holds a layer range")
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        start = 0 if not past else past[0][0].shape[0]
        end = start + ids.shape[0]
        if end > self.cfg.max_context:
            raise ValueError(f"{end} tokens exceed the model's context of {self.cfg.max_context}")
        buffers = self.kv_buffers(end)
        h = self.embed(ids)
        new: list[KV] = []
        for layer in range(self.cfg.num_layers):
            k_buf, v_buf = buffers[layer]
            if past:
                k_buf[:start] = past[layer][0]
                v_buf[:start] = past[layer][1]
            h = self.run_layer(layer, h, start, k_buf, v_buf)
            new.append((k_buf[start:end], v_buf[start:end]))
            if on_layer is not None:
                on_layer(layer, *new[-1])
        return self.logits(h), new


def build_model(
    preset: str | ModelConfig,
    seed: int = 0,
    *,
    device: str | torch.device = "cpu",
    dtype: str | None = None,
    block_tokens: int | None = None,
    layers: Sequence[int] | None = None,
) -> Transformer:
    """The preset's model (by name or config) with weights drawn from ``seed``, or the
    checkpoint in directory ``preset`` (``seed`` unused)."""
    if isinstance(preset, str) and is_checkpoint_path(preset):
        ck = read_checkpoint(preset, block_tokens=block_tokens, dtype=dtype)
        return Transformer(ck.model, device=device, layers=layers, checkpoint=ck)
    cfg = get_preset(preset) if isinstance(preset, str) else preset
    if block_tokens is not None:
        cfg = cfg.with_block_tokens(block_tokens)
    return Transformer(cfg, seed, device=device, dtype=dtype, layers=layers)


@torch.inference_mode()
def generate(
    model: Transformer,
    tokens: Sequence[int] | Tensor,
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
) -> list[int]:
    """Reference greedy generation: recompute the whole sequence at every step, no cache."""
    seq = [int(t) for t in tokens]
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits, _ = model(seq)
        token = int(torch.argmax(logits[-1]))
        out.append(token)
        seq.append(token)
        if token == eos_id:
            break
    return out
