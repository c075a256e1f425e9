"""The reference model: presets, deterministic weights, chunked == one-shot, tokenizer."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch

from kvpool.serve.runtime.model import build_model, generate
from kvpool.serve.runtime.tokenizer import BOS, EOS, VOCAB_SIZE, ByteTokenizer
from kvpool.serve.sched.presets import LLAMA2_7B, LLAMA2_70B, TINY, get_preset

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return build_model("tiny", seed=0, block_tokens=16)


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- presets ------------------------------------------------------------------


def test_preset_shapes_and_sizes() -> None:
    assert TINY.max_context >= 16384 and TINY.vocab_size == VOCAB_SIZE
    assert TINY.kv_layout().block_tokens == 512 and TINY.kv_layout().dtype == "float32"
    assert get_preset("tiny", block_tokens=16).kv_layout().block_tokens == 16
    # LLaMA-2 published sizes: 6.74 B and 68.98 B parameters.
    assert abs(LLAMA2_7B.num_params() - 6.74e9) < 0.01e9
    assert abs(LLAMA2_70B.num_params() - 68.98e9) < 0.01e9
    # DESIGN.md: 70B KV is 320 KiB per token, 160 MiB per 512-token block.
    layout = LLAMA2_70B.kv_layout()
    assert LLAMA2_70B.kv_bytes_per_token == layout.bytes_per_token == 327_680
    assert layout.block_bytes == 160 << 20 and layout.layer_bytes == 2 << 20
    assert LLAMA2_7B.kv_bytes_per_token == 512 << 10
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("gpt-5")


def test_cost_model_is_consistent() -> None:
    cfg = LLAMA2_70B
    # Prefilling a+b tokens at once costs the same as a, then b after a cached.
    assert cfg.prefill_flops(3000) == cfg.prefill_flops(1000) + cfg.prefill_flops(2000, 1000)
    # ~2 x params per token plus attention.
    assert 2 * cfg.num_params() * 0.95 < cfg.flops_per_token(0) < 2 * cfg.num_params()
    assert cfg.flops_per_token(4096) > cfg.flops_per_token(0)
    assert cfg.decode_step_bytes([100, 200]) == cfg.weight_bytes() + 302 * 327_680
    assert cfg.decode_step_flops([10]) == cfg.flops_per_token(11)


def test_namespace_separates_seeds_and_block_sizes() -> None:
    assert TINY.namespace(0) != TINY.namespace(1)
    assert TINY.namespace(0).digest() != TINY.with_block_tokens(16).namespace(0).digest()


# -- weights ------------------------------------------------------------------


def test_weights_deterministic_and_seeded(tiny: torch.nn.Module) -> None:
    again = build_model("tiny", seed=0, block_tokens=16)
    assert _digest(again) == _digest(tiny)
    other = build_model("tiny", seed=1, block_tokens=16)
    assert not torch.equal(other.layers["0"].q_proj.weight, tiny.layers["0"].q_proj.weight)
    # A pipeline stage holding layers 2-3 has exactly the full model's weights there.
    stage = build_model("tiny", seed=0, block_tokens=16, layers=[2, 3])
    assert list(stage.layers.keys()) == ["2", "3"]
    for name, p in stage.state_dict().items():
        assert torch.equal(p, tiny.state_dict()[name]), name


def test_weights_and_outputs_identical_across_processes(tiny: torch.nn.Module) -> None:
    prompt = list(range(40, 80))
    code = (
        "import torch, hashlib\n"
        "torch.set_num_threads(1)\n"
        "from kvpool.serve.runtime.model import build_model\n"
        "m = build_model('tiny', seed=0, block_tokens=16)\n"
        "h = hashlib.sha256()\n"
        "for n, p in sorted(m.state_dict().items()):\n"
        "    h.update(n.encode()); h.update(p.contiguous().view(torch.uint8).numpy().tobytes())\n"
        f"logits, _ = m({prompt!r})\n"
        "print(h.hexdigest(), hashlib.sha256(logits.numpy().tobytes()).hexdigest())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    logits, _ = tiny(prompt)
    assert out == [_digest(tiny), hashlib.sha256(logits.numpy().tobytes()).hexdigest()]


# -- forward ------------------------------------------------------------------


def test_chunked_forward_matches_one_shot(tiny: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (90,), generator=g)
    full_logits, full_kv = tiny(tokens)
    assert full_logits.shape == (90, VOCAB_SIZE) and full_logits.dtype == torch.float32
    assert full_kv[0][0].shape == (90, TINY.num_kv_heads, TINY.head_dim)
    # forward() with a past, in three uneven pieces.
    past = None
    pieces = []
    for a, b in [(0, 31), (31, 32), (32, 90)]:
        logits, kv = tiny(tokens[a:b], past)
        pieces.append(logits)
        past = (
            kv
            if past is None
            else [
                (torch.cat([pk, k]), torch.cat([pv, v]))
                for (pk, pv), (k, v) in zip(past, kv, strict=True)
            ]
        )
    torch.testing.assert_close(torch.cat(pieces), full_logits, atol=1e-4, rtol=1e-4)
    for (k, v), (fk, fv) in zip(past, full_kv, strict=True):
        torch.testing.assert_close(k, fk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, fv, atol=1e-5, rtol=1e-5)
    # The explicit layer loop over preallocated buffers, chunks of 7.
    buffers = tiny.kv_buffers(90)
    outs = []
    with torch.inference_mode():
        for a in range(0, 90, 7):
            h = tiny.embed(tokens[a : a + 7])
            for layer in range(TINY.num_layers):
                h = tiny.run_layer(layer, h, a, *buffers[layer])
            outs.append(tiny.logits(h))
    torch.testing.assert_close(torch.cat(outs), full_logits, atol=1e-4, rtol=1e-4)


def test_on_layer_hook_sees_each_layer_in_order(tiny: torch.nn.Module) -> None:
    seen: list[int] = []

    def hook(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert k.shape == v.shape == (5, TINY.num_kv_heads, TINY.head_dim)
        seen.append(layer)

    tiny([1, 2, 3, 4, 5], on_layer=hook)
    assert seen == list(range(TINY.num_layers))


def test_long_context_positions(tiny: torch.nn.Module) -> None:
    """One token at position 16383 after a (random) 16k-token past."""
    g = torch.Generator().manual_seed(0)
    shape = (16383, TINY.num_kv_heads, TINY.head_dim)
    past = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g))] * TINY.num_layers
    logits, _ = tiny([7], past)
    assert logits.shape == (1, VOCAB_SIZE) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="context"):
        tiny(list(range(TINY.max_context + 1)))


def test_generate_is_greedy_and_stops_at_eos(tiny: torch.nn.Module) -> None:
    prompt = [BOS, *range(60, 70)]
    out = generate(tiny, prompt, 5)
    assert len(out) == 5
    logits, _ = tiny(prompt)
    assert out[0] == int(torch.argmax(logits[-1]))
    assert generate(tiny, prompt, 5, eos_id=out[1]) == out[:2]


# -- tokenizer ----------------------------------------------------------------


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "héllo, KV → pool 🚀"
    ids = tok.encode(text)
    assert ids[0] == BOS and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.encode("ab", add_bos=False) == [97, 98]
    assert tok.decode([97, EOS, 31999, 98]) == "ab"  # specials and out-of-range ids dropped
    assert tok.decode([0xFF, 97]) == "\ufffda"
    stream = tok.decode_stream()
    pieces = [stream.feed(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert pieces[-1] == "🚀" and pieces[-2] == ""  # a split character waits for its last byte
