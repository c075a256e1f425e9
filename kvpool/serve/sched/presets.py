"""Model shapes for the reference runtime and the simulator's cost model.

A ``ModelConfig`` fixes a LLaMA-architecture decoder's geometry. The same
object gives the KV layout the pool stores (``kv_layout``), the namespace its
blocks live in (``namespace``), and analytic costs (parameters, FLOPs and
bytes per token) that the conductor's and simulator's cost models start from.

Presets:

| name | layers | hidden | heads / kv | head_dim | mlp | vocab | context | KV / token |
|---|---|---|---|---|---|---|---|---|
| ``tiny`` | 4 | 128 | 4 / 2 | 32 | 384 | 260 | 32768 | 2 KiB (fp32) |
| ``llama2-7b`` | 32 | 4096 | 32 / 32 | 128 | 11008 | 32000 | 4096 | 512 KiB (bf16) |
| ``llama2-70b`` | 80 | 8192 | 64 / 8 | 128 | 28672 | 32000 | 4096 | 320 KiB (bf16) |

``tiny`` uses the byte-level tokenizer's vocabulary (256 bytes + 4 specials)
and float32 (CPU); the LLaMA-2 shapes are the published ones in bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpool.index.keys import Namespace
from kvpool.layout import KVLayout


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of a LLaMA-architecture decoder; immutable and hashable."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    dtype: str = "bfloat16"
    block_tokens: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embeddings rotate pairs)")
        self.kv_layout()  # the pool's checks of the KV geometry and dtype (ValueError)

    # -- geometry --------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def dtype_bytes(self) -> int:
        return self.kv_layout().dtype_bytes

    def with_block_tokens(self, block_tokens: int) -> ModelConfig:
        """The same model with another pool block size (tests use small blocks)."""
        return replace(self, block_tokens=block_tokens)

    def kv_layout(self) -> KVLayout:
        """How one block of this model's KV is laid out in the pool."""
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            block_tokens=self.block_tokens,
        )

    def model_id(self, seed: int) -> str:
        """Identifies the weights: KV computed under another seed must never be shared."""
        return f"kvpool-serve/{self.name}/seed{seed}"

    def namespace(self, seed: int = 0, tenant: str | None = None) -> Namespace:
        return Namespace(self.model_id(seed), layout=self.kv_layout(), tenant=tenant)

    # -- analytic costs --------------------------------------------------------

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_params(self) -> int:
        h = self.hidden_size
        attn = h * h + 2 * h * self.kv_dim + h * h  # q, k, v, o
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        return attn + mlp + 2 * h  # two RMSNorm weights

    def num_params(self) -> int:
        """All weights: embedding, layers, final norm, untied LM head."""
        h, v = self.hidden_size, self.vocab_size
        return v * h + self.num_layers * self.layer_params() + h + v * h

    def weight_bytes(self) -> int:
        return self.num_params() * self.dtype_bytes

    def matmul_params(self) -> int:
        """Weights a token multiplies through (layers' projections and the LM head)."""
        h = self.hidden_size
        return self.num_layers * (self.layer_params() - 2 * h) + self.vocab_size * h

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_dim * self.dtype_bytes

    def attention_flops_per_pair(self) -> int:
        """FLOPs for one (query, key) pair over all layers and heads: QK^T and PV."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def flops_per_token(self, context: int = 0) -> int:
        """Forward FLOPs of one token attending to ``context`` tokens (itself included)."""
        return 2 * self.matmul_params() + self.attention_flops_per_pair() * context

    def prefill_flops(self, new_tokens: int, cached_tokens: int = 0) -> int:
        """Forward FLOPs to prefill ``new_tokens`` after ``cached_tokens`` reused ones.

        Linear part: ``2 x params`` per token; attention part: each new token i
        (0-based) attends to ``cached_tokens + i + 1`` keys, so it is quadratic
        in the new length and linear in the cached one (causal).
        """
        n, c = new_tokens, cached_tokens
        pairs = n * c + n * (n + 1) // 2
        return 2 * self.matmul_params() * n + self.attention_flops_per_pair() * pairs

    def decode_step_flops(self, contexts: list[int]) -> int:
        """FLOPs of one decode step for a batch whose requests hold ``contexts`` tokens."""
        return sum(self.flops_per_token(c + 1) for c in contexts)

    def decode_step_bytes(self, contexts: list[int]) -> int:
        """Bytes one decode step reads: the weights once, plus each request's whole KV."""
        return self.weight_bytes() + sum(c + 1 for c in contexts) * self.kv_bytes_per_token


TINY = ModelConfig(
    name="tiny",
    num_layers=4,
    hidden_size=128,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=384,
    vocab_size=260,
    max_context=32768,
    dtype="float32",
)

LLAMA2_7B = ModelConfig(
    name="llama2-7b",
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=32,
    intermediate_size=11008,
    vocab_size=32000,
    max_context=4096,
)

LLAMA2_70B = ModelConfig(
    name="llama2-70b",
    num_layers=80,
    hidden_size=8192,
    num_heads=64,
    num_kv_heads=8,
    intermediate_size=28672,
    vocab_size=32000,
    max_context=4096,
)

PRESETS: dict[str, ModelConfig] = {c.name: c for c in (TINY, LLAMA2_7B, LLAMA2_70B)}


def get_preset(name: str, *, block_tokens: int | None = None) -> ModelConfig:
    """The named preset, optionally with another pool block size."""
    try:
        config = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}") from None
    return config if block_tokens is None else config.with_block_tokens(block_tokens)
