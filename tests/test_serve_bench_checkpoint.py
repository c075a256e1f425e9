"""The benchmarks' tiny checkpoint (``kvpool.bench.tiny_checkpoint``, written without
``transformers``) is a real Hugging Face checkpoint: ``transformers`` loads it and computes
the logits kvpool's runtime computes, and its tokenizer encodes like ``AutoTokenizer``."""

from __future__ import annotations

import pathlib

import pytest
import torch

from kvpool.bench.tiny_checkpoint import TinyShape, write_tiny_checkpoint
from kvpool.serve.runtime.checkpoint.config import read_checkpoint
from kvpool.serve.runtime.checkpoint.hf_tokenizer import HFTokenizer
from kvpool.serve.runtime.model import build_model

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is absent")


@pytest.mark.parametrize("tie", [False, True])
def test_transformers_loads_it_and_agrees(tmp_path: pathlib.Path, tie: bool) -> None:
    path = write_tiny_checkpoint(tmp_path / "tiny", shape=TinyShape(layers=2), tie=tie)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(2, 258, (700,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, _ = build_model(str(path))(ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    text = "kvpool: Grüße 🚀"
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert HFTokenizer(read_checkpoint(path)).encode(text) == tok(text)["input_ids"]
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1


def test_bad_shapes_are_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="heads"):
        write_tiny_checkpoint(tmp_path / "x", shape=TinyShape(hidden=100, heads=3))
    with pytest.raises(ValueError, match="dtype"):
        write_tiny_checkpoint(tmp_path / "y", dtype="int8")
