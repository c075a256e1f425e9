"""Hugging Face checkpoints: exact against ``transformers`` (logits, greedy tokens through
prefill -> pool -> decode, cached prefixes, pipeline prefill, the HTTP API), the namespace
digest, and every bad checkpoint refused at start-up naming what is wrong."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from kvpool import Pool, procs
from kvpool.serve.runtime.checkpoint.config import read_checkpoint
from kvpool.serve.runtime.checkpoint.errors import CheckpointError
from kvpool.serve.runtime.checkpoint.hf_tokenizer import HFTokenizer
from kvpool.serve.runtime.decode import DecodeEngine
from kvpool.serve.runtime.model import Transformer, build_model
from kvpool.serve.runtime.prefill import PrefillWorker

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is absent")
from hf_checkpoints import CHAT_TEMPLATE, make_checkpoint  # noqa: E402
from servehelpers import Server, start_serve  # noqa: E402

torch.set_num_threads(1)
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "llama3-rope-tied": {"tie": True, "rope_scaling": LLAMA3, "chat_template": CHAT_TEMPLATE},
    "qwen2-bias": {"kind": "qwen2"},
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("hf")
    return {name: make_checkpoint(root / name, **kw) for name, kw in VARIANTS.items()}


def reference(path: pathlib.Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def ref_generate(ref: Any, ids: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate`` (every position attended: the prompt holds the
    BOS id, which would otherwise be taken for padding)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = ref.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=None,
        )
    return [int(t) for t in out[0, len(ids) :]]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 258, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- exactness ----------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_over_several_blocks_match_transformers(
    ckpts: dict[str, pathlib.Path], variant: str
) -> None:
    model = build_model(str(ckpts[variant]))
    ids = prompt(3 * 512 + 37, seed=1)  # four 512-token blocks, the last partial
    ours, _ = model(ids)
    with torch.no_grad():
        theirs = reference(ckpts[variant])(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def llama(ckpts: dict[str, pathlib.Path]) -> Transformer:
    return build_model(str(ckpts["llama3-rope-tied"]), block_tokens=16)


def test_prefill_pool_decode_greedy_equals_generate_with_and_without_prefix(
    ckpts: dict[str, pathlib.Path], llama: Transformer
) -> None:
    ref = reference(ckpts["llama3-rope-tied"])
    shared = prompt(80, seed=2)
    with (
        Pool.embedded(dram_bytes=32 << 20) as pool,
        PrefillWorker(llama, pool, chunk_tokens=32, native_layerwise=False) as pw,
    ):
        for suffix_seed, cached in ((3, False), (4, True)):
            ids = shared + prompt(21, seed=suffix_seed)
            result = pw.prefill(ids)
            assert (result.cached_tokens > 0) == cached
            engine = DecodeEngine(llama, pool, num_pages=64, page_tokens=8, native_layerwise=False)
            req = engine.submit(result, 12)
            engine.run()
            assert req.output == ref_generate(ref, ids, 12)


def test_namespace_has_the_weights_digest(
    ckpts: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    other = make_checkpoint(tmp_path / "llama", seed=1)  # same shapes, other weights
    a, b = read_checkpoint(ckpts["llama"]), read_checkpoint(other)
    assert a.model.kv_layout() == b.model.kv_layout()
    assert a.model.namespace() != b.model.namespace()
    assert read_checkpoint(ckpts["llama"]).model.namespace() == a.model.namespace()


def test_tokenizer_matches_transformers(ckpts: dict[str, pathlib.Path]) -> None:
    path = ckpts["llama"]
    ours, theirs = (
        HFTokenizer(read_checkpoint(path)),
        transformers.AutoTokenizer.from_pretrained(path),
    )
    text = "Grüße, kvpool! 🚀 ok"
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.encode(text)[0] == ours.bos_id == 0 and ours.eos_id == 1
    ids = ours.encode(text)
    stream = ours.decode_stream()
    assert "".join(stream.feed(t) for t in ids) + stream.flush() == text == ours.decode(ids)


# -- kvpool serve end to end ----------------------------------------------------


@pytest.fixture(scope="module")
def server(ckpts: dict[str, pathlib.Path]) -> Iterator[Server]:
    server = start_serve(
        [
            *("--model", str(ckpts["llama3-rope-tied"]), "--port", "0"),
            *("--prefill", "2", "--cpp-group", "2", "--cpp-min-tokens", "150"),
            *("--block-tokens", "16", "--chunk-tokens", "32", "--dram", "64MiB"),
            *("--kv-tokens", "2048", "--page-tokens", "8"),
            *("--api-key", KEY, "--max-body-bytes", "64KiB"),
        ],
        timeout=120,
    )
    yield server
    popen = server.popen
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(10)


@pytest.mark.parametrize("length,pipelined", [(60, False), (200, True)])
def test_served_greedy_tokens_equal_generate(
    server: Server, ckpts: dict[str, pathlib.Path], length: int, pipelined: bool
) -> None:
    ids = prompt(length, seed=length)
    body = {"prompt": ids, "max_tokens": 10, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120, headers=AUTH)
    assert r.status_code == 200, r.text
    out = r.json()
    assert bool(out["kvpool"]["pipeline"]) == pipelined
    expected = ref_generate(reference(ckpts["llama3-rope-tied"]), ids, 10)
    assert out["choices"][0]["token_ids"] == expected


def test_text_prompt_uses_the_checkpoints_tokenizer(
    server: Server, ckpts: dict[str, pathlib.Path]
) -> None:
    path = ckpts["llama3-rope-tied"]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    text = "The pool keeps every block once. " * 3
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": text, "max_tokens": 6},
        timeout=120,
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    ids = tok(text)["input_ids"]
    assert out["usage"]["prompt_tokens"] == len(ids)
    expected = ref_generate(reference(path), ids, 6)
    got = out["choices"][0]["token_ids"]
    n = expected.index(1) + 1 if 1 in expected else len(expected)  # stops at EOS (id 1)
    assert got == expected[:n]
    assert out["choices"][0]["text"] == tok.decode(got, skip_special_tokens=True)


# -- bad checkpoints: refused at start-up ------------------------------------------


def _edit_config(path: pathlib.Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _bad_copy(src: pathlib.Path, dst: pathlib.Path, case: str) -> pathlib.Path:
    shutil.copytree(src, dst)
    if case == "no config":
        (dst / "config.json").unlink()
    elif case == "model_type":
        _edit_config(dst, model_type="gpt2")
    elif case == "rope_scaling":
        _edit_config(dst, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    elif case == "sliding_window":
        _edit_config(dst, model_type="mistral", sliding_window=128)
    elif case == "vocab":
        _edit_config(dst, vocab_size=100)
    elif case == "missing shard":
        (dst / "model.safetensors").rename(dst / "model-00001-of-00001.safetensors")
        weight_map = {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}
        index = {"metadata": {}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    elif case == "no tokenizer":
        (dst / "tokenizer.json").unlink()
    return dst


BAD = {
    "no config": "config.json is missing",
    "model_type": "'model_type' 'gpt2' is not implemented",
    "rope_scaling": "'rope_scaling' of type 'yarn' is not implemented",
    "sliding_window": "'sliding_window' 128",
    "vocab": "embed_tokens.weight has shape",
    "missing shard": "shard model-00002-of-00002.safetensors",
    "no tokenizer": "tokenizer.json is missing",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_refused_naming_the_cause(
    ckpts: dict[str, pathlib.Path], tmp_path: pathlib.Path, case: str
) -> None:
    path = _bad_copy(ckpts["llama"], tmp_path / "bad", case)
    with pytest.raises(CheckpointError, match=re.escape(BAD[case])):
        read_checkpoint(path)


def test_tokenizer_larger_than_the_vocabulary_is_refused(
    ckpts: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "ck"
    shutil.copytree(ckpts["llama"], path)
    tok = json.loads((path / "tokenizer.json").read_text())
    # another model's tokenizer: a larger vocabulary than these weights' embedding
    tok["model"]["vocab"].update({f"<extra{i}>": i for i in range(258, 301)})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(CheckpointError, match=r"tokenizer\.json has token id 300"):
        read_checkpoint(path)


def test_serve_refuses_a_bad_checkpoint_before_starting_anything(tmp_path: pathlib.Path) -> None:
    done = subprocess.run(
        [sys.executable, *procs.kvpool_args("serve", "--model", str(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "config.json is missing" in done.stderr
    assert "ready" not in done.stdout


# -- stopping and parameters ---------------------------------------------------------


def _post(server: Server, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120, headers=AUTH)


def _stream_text(server: Server, **body: Any) -> tuple[str, list[int], str | None]:
    text, ids, finish = "", [], None
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={**body, "stream": True},
        timeout=120,
        headers=AUTH,
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])["choices"][0]
            text += c["text"]
            ids += c["token_ids"]
            finish = c["finish_reason"] or finish
    return text, ids, finish


def test_stop_strings_and_stop_token_ids_end_the_completion(server: Server) -> None:
    ids = prompt(40, seed=7)
    full = _post(server, prompt=ids, max_tokens=24, ignore_eos=True).json()["choices"][0]
    assert full["finish_reason"] == "length"
    text, tokens = full["text"], full["token_ids"]
    k = next(i for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[k : k + 2]
    want = text[: text.find(stop)]
    got = _post(server, prompt=ids, max_tokens=24, ignore_eos=True, stop=[stop, "\x00\x01"])
    c = got.json()["choices"][0]
    assert (c["text"], c["finish_reason"]) == (want, "stop")
    assert len(c["token_ids"]) < len(tokens) and tokens[: len(c["token_ids"])] == c["token_ids"]
    assert _stream_text(server, prompt=ids, max_tokens=24, ignore_eos=True, stop=stop)[::2] == (
        want,
        "stop",
    )
    # a stop token id: the output ends with it (its text is left out)
    at = 5
    stop_id = tokens[at]
    first = tokens.index(stop_id)
    c = _post(server, prompt=ids, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]).json()[
        "choices"
    ][0]
    assert c["token_ids"] == tokens[: first + 1] and c["finish_reason"] == "stop"
    s_text, s_ids, s_finish = _stream_text(
        server, prompt=ids, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]
    )
    assert (s_text, s_ids, s_finish) == (c["text"], c["token_ids"], "stop")


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1),
        ("top_p", 0),
        ("top_k", "x"),
        ("seed", 1.5),
        ("logprobs", 21),
        ("logprobs", True),
        ("top_logprobs", 2),
        ("n", 0),
        ("n", 17),
        ("echo", True),
        ("presence_penalty", 0.5),
        ("frobnicate", 1),
        ("stop", 3),
        ("stop_token_ids", [100000]),
    ],
)
def test_unsupported_parameters_answer_400_naming_them(
    server: Server, field: str, value: Any
) -> None:
    r = _post(server, prompt=[5, 6, 7], max_tokens=2, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_neutral_parameter_values_are_accepted(server: Server) -> None:
    neutral = {"temperature": 0, "top_p": 1.0, "n": 1, "seed": 42, "logprobs": None}
    r = _post(server, prompt=[5, 6, 7], max_tokens=2, ignore_eos=True, **neutral)
    assert r.status_code == 200, r.text


# -- chat ---------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Which blocks does the pool keep?"},
]


def test_chat_renders_the_checkpoints_template_like_transformers(
    server: Server, ckpts: dict[str, pathlib.Path]
) -> None:
    path = ckpts["llama3-rope-tied"]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected = ref_generate(reference(path), list(ids), 8)
    n = expected.index(1) + 1 if 1 in expected else len(expected)
    body = {"messages": MESSAGES, "max_completion_tokens": 8}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120, headers=AUTH)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["usage"]["completion_tokens"] == n
    msg = out["choices"][0]["message"]
    assert msg == {
        "role": "assistant",
        "content": tok.decode(expected[:n], skip_special_tokens=True),
    }
    assert out["choices"][0]["finish_reason"] == ("stop" if n < 8 else "length")
    # streamed: the same text in deltas, the role first, usage last
    deltas, finish, usage = [], None, None
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=120,
        headers=AUTH,
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert chunk["object"] == "chat.completion.chunk"
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    deltas.append(c["delta"])
                    finish = c["finish_reason"] or finish
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == msg["content"]
    assert finish == out["choices"][0]["finish_reason"] and usage is not None
    for key in ("prompt_tokens", "completion_tokens"):  # the prompt is now cached in the pool
        assert usage[key] == out["usage"][key]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"messages": MESSAGES, "prompt": "x"}, "prompt"),
        ({"messages": MESSAGES, "n": 0}, "n"),
        ({"messages": MESSAGES, "logprobs": 3}, "logprobs"),
        ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_chat_requests_answer_400(server: Server, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_without_a_template_answers_400(ckpts: dict[str, pathlib.Path]) -> None:
    from kvpool.serve.runtime.checkpoint.chat import ChatTemplate
    from kvpool.serve.runtime.http.chat import parse_chat
    from kvpool.serve.runtime.http.openai import ApiError
    from kvpool.serve.runtime.http.state import ServeSettings

    ckpt = read_checkpoint(ckpts["llama"])
    assert ChatTemplate.load(ckpts["llama"]) is None
    settings = ServeSettings(model=ckpt.model, served_name="m", checkpoint=ckpt)
    with pytest.raises(ApiError, match="no chat template") as err:
        parse_chat({"messages": MESSAGES}, settings, settings.tokenizer(), None)
    assert err.value.status == 400


# -- front-end limits -----------------------------------------------------------------


def test_api_key_guards_v1_but_not_health_or_metrics(server: Server) -> None:
    body = {"prompt": [5, 6], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401
        assert httpx.get(f"{server.url}/v1/models", headers=headers, timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200


def test_request_body_over_the_limit_answers_413(server: Server) -> None:
    big = {"prompt": [5] * 40000, "max_tokens": 1}  # ~120 KB of JSON > 64 KiB
    r = httpx.post(f"{server.url}/v1/completions", json=big, headers=AUTH, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while read
        yield b'{"prompt": ['
        for _ in range(30000):
            yield b"5, "
        yield b'5], "max_tokens": 1}'

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=AUTH, timeout=30)
    assert r.status_code == 413
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": [5, 6], "max_tokens": 1},
        headers=AUTH,
        timeout=30,
    )
    assert ok.status_code == 200, ok.text


# -- sampling -------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_follows_the_seed(server: Server) -> None:
    def run(seed: int, length: int) -> list[int]:
        r = _post(
            server,
            prompt=prompt(length, 9),
            max_tokens=12,
            ignore_eos=True,
            temperature=1.0,
            top_p=0.95,
            top_k=50,
            seed=seed,
        )
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    for length in (60, 200):  # one prefill worker; the pipeline group
        a = run(7, length)
        assert run(7, length) == a  # the second one's prompt is cached in the pool
        assert run(8, length) != a
    greedy = _post(server, prompt=prompt(60, 9), max_tokens=12, ignore_eos=True).json()
    assert greedy["choices"][0]["token_ids"] != run(7, 60)


def test_sampled_tokens_through_the_pool_equal_the_reference_loop(llama: Transformer) -> None:
    from kvpool.serve.runtime.sampling import SamplingParams, sample

    params = [SamplingParams(0.8, 0.9, 40, seed) for seed in (1, 2)]
    ids = [prompt(50, seed=11), prompt(37, seed=12)]
    want = []
    for p, tokens in zip(params, ids, strict=True):
        seq, out = list(tokens), []
        for i in range(10):
            logits, _ = llama(seq)
            out.append(sample(logits[-1], p, i))
            seq.append(out[-1])
        want.append(out)
    with (
        Pool.embedded(dram_bytes=32 << 20) as pool,
        PrefillWorker(llama, pool, chunk_tokens=32, native_layerwise=False) as pw,
    ):
        engine = DecodeEngine(llama, pool, num_pages=64, page_tokens=8, native_layerwise=False)
        reqs = [  # decoded in one batch: the batch does not change a request's draws
            engine.submit(pw.prefill(t, sampling=p), 10, sampling=p)
            for p, t in zip(params, ids, strict=True)
        ]
        engine.run()
    assert [r.output for r in reqs] == want


def test_bfloat16_checkpoint_matches_transformers(tmp_path: pathlib.Path) -> None:
    path = make_checkpoint(tmp_path / "bf16", dtype="bfloat16", rope_scaling=LLAMA3)
    model = build_model(str(path))
    assert model.dtype == torch.bfloat16 and model.cfg.kv_layout().dtype == "bfloat16"
    ids = prompt(600, seed=5)
    ours, _ = model(ids)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_sharded_checkpoint_and_a_stage_reads_only_its_layers(tmp_path: pathlib.Path) -> None:
    path = make_checkpoint(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (path / "model.safetensors.index.json").is_file()
    ids = prompt(100, seed=3)
    with torch.no_grad():
        theirs = reference(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(build_model(str(path))(ids)[0], theirs, rtol=0, atol=0)
    # a stage holding layer 1 only reads none of layer 0's tensors: with the checkpoint
    # checked (headers), the shards holding only layer 0 can even be unreadable
    ckpt = read_checkpoint(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    others = {f for n, f in index.items() if not n.startswith("model.layers.0.")}
    only_l0 = {f for n, f in index.items() if n.startswith("model.layers.0.")} - others
    assert only_l0, "the shard size should isolate some of layer 0"
    ref_sd = reference(path).state_dict()
    for f in only_l0:
        (path / f).write_bytes(b"\0" * 16)
    stage = Transformer(ckpt.model, layers=[1], checkpoint=ckpt)
    assert stage.layer_ids == [1]
    torch.testing.assert_close(
        stage.layer(1).q_proj.weight, ref_sd["model.layers.1.self_attn.q_proj.weight"]
    )
    torch.testing.assert_close(stage.lm_head.weight, ref_sd["lm_head.weight"])


def test_every_eos_id_of_the_checkpoint_stops_a_request(
    ckpts: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    from kvpool.serve.runtime.http.openai import parse_completion
    from kvpool.serve.runtime.http.state import ServeSettings

    path = tmp_path / "eos"
    shutil.copytree(ckpts["llama"], path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    ckpt = read_checkpoint(path)
    assert ckpt.eos_ids == (1, 5) and ckpt.eos_id == 1
    settings = ServeSettings(model=ckpt.model, served_name="m", checkpoint=ckpt)
    fields = parse_completion({"prompt": [7, 8]}, settings, settings.tokenizer())
    assert fields.eos_id == 1 and fields.stop_token_ids == {1, 5}
    fields = parse_completion(
        {"prompt": [7, 8], "ignore_eos": True}, settings, settings.tokenizer()
    )
    assert fields.eos_id is None and fields.stop_token_ids == frozenset()


# -- logprobs and n ------------------------------------------------------------------


def ref_logprobs(ref: Any, ids: list[int], out: list[int]) -> torch.Tensor:
    """transformers' log_softmax of its logits at each output position ``[len(out), vocab]``."""
    with torch.no_grad():
        logits = ref(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1]
    return torch.log_softmax(logits.float(), -1)


def test_logprobs_through_prefill_pool_decode_equal_transformers(
    ckpts: dict[str, pathlib.Path], llama: Transformer
) -> None:
    from kvpool.serve.runtime.sampling import SamplingParams

    ref = reference(ckpts["llama3-rope-tied"])
    params = SamplingParams(logprobs=5)  # greedy
    shared = prompt(80, seed=21)
    with (
        Pool.embedded(dram_bytes=32 << 20) as pool,
        PrefillWorker(llama, pool, chunk_tokens=32, native_layerwise=False) as pw,
    ):
        for suffix_seed, cached in ((22, False), (23, True)):
            ids = shared + prompt(21, seed=suffix_seed)
            result = pw.prefill(ids, sampling=params)
            assert (result.cached_tokens > 0) == cached
            engine = DecodeEngine(llama, pool, num_pages=64, page_tokens=8, native_layerwise=False)
            engine.submit(result, 10, sampling=params)
            events = []
            while not engine.idle:
                events.extend(engine.step())
            out = [e.token for e in events]
            assert out == ref_generate(ref, ids, 10)
            want = ref_logprobs(ref, ids, out)
            for i, e in enumerate(events):
                assert e.logprobs is not None
                lp, alts = e.logprobs
                assert lp == pytest.approx(float(want[i, e.token]), abs=1e-5)
                top = torch.topk(want[i], 5)
                assert [a for a, _ in alts] == top.indices.tolist()
                torch.testing.assert_close(
                    torch.tensor([v for _, v in alts]), top.values, rtol=0, atol=1e-5
                )
                assert alts[0][0] == e.token  # greedy: the sampled token is the most likely


@pytest.mark.parametrize("length", [60, 200])  # one prefill worker; the pipeline group
def test_served_logprobs_equal_transformers(
    server: Server, ckpts: dict[str, pathlib.Path], length: int
) -> None:
    path = ckpts["llama3-rope-tied"]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = prompt(length, seed=30 + length)
    r = _post(server, prompt=ids, max_tokens=6, ignore_eos=True, logprobs=3)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    out = c["token_ids"]
    ref = reference(path)
    assert out == ref_generate(ref, ids, 6)
    want = ref_logprobs(ref, ids, out)
    lp = c["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in out]
    for i, t in enumerate(out):
        assert lp["token_logprobs"][i] == pytest.approx(float(want[i, t]), abs=1e-5)
        top = torch.topk(want[i], 3)
        expected = {tok.decode([j]): float(v) for j, v in zip(top.indices, top.values, strict=True)}
        assert lp["top_logprobs"][i] == pytest.approx(expected, abs=1e-5)
    assert lp["text_offset"][0] == 0
    # streamed: each chunk carries its token's logprobs, the same values
    streamed: list[float] = []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={"prompt": ids, "max_tokens": 6, "ignore_eos": True, "logprobs": 3, "stream": True},
        timeout=120,
        headers=AUTH,
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    streamed += ch["logprobs"]["token_logprobs"]
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-6)


def test_chat_logprobs(server: Server, ckpts: dict[str, pathlib.Path]) -> None:
    path = ckpts["llama3-rope-tied"]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True))
    body = {"messages": MESSAGES, "max_tokens": 5, "ignore_eos": True}
    body |= {"logprobs": True, "top_logprobs": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120, headers=AUTH)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    ref = reference(path)
    out = ref_generate(ref, ids, 5)
    want = ref_logprobs(ref, ids, out)
    assert [e["token"] for e in content] == [tok.decode([t]) for t in out]
    for i, (e, t) in enumerate(zip(content, out, strict=True)):
        assert e["logprob"] == pytest.approx(float(want[i, t]), abs=1e-5)
        assert e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
    off = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 2, "logprobs": False},
        timeout=120,
        headers=AUTH,
    )
    assert off.status_code == 200 and off.json()["choices"][0]["logprobs"] is None


def test_n_completions_differ_reproducibly_and_stream_interleaved(server: Server) -> None:
    ids = prompt(60, seed=40)
    body = {"prompt": ids, "max_tokens": 8, "ignore_eos": True, "temperature": 1.0, "seed": 5}
    r = _post(server, n=3, **body)
    assert r.status_code == 200, r.text
    out = r.json()
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    tokens = [c["token_ids"] for c in choices]
    assert len({tuple(t) for t in tokens}) == 3  # each choice has its own seed
    assert out["usage"]["completion_tokens"] == 24 and out["usage"]["prompt_tokens"] == 60
    again = _post(server, n=3, **body).json()
    assert [c["token_ids"] for c in again["choices"]] == tokens  # same seed, same choices
    single = _post(server, **body).json()
    assert single["choices"][0]["token_ids"] == tokens[0]  # choice 0 keeps the seed
    # streamed: chunks of every choice, each naming its index, the same tokens
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    order, usage, chunk_ids = [], None, set()
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={**body, "n": 3, "stream": True, "stream_options": {"include_usage": True}},
        timeout=120,
        headers=AUTH,
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                chunk_ids.add(chunk["id"])
                usage = chunk.get("usage") or usage
                for ch in chunk["choices"]:
                    got[ch["index"]] += ch["token_ids"]
                    order.append(ch["index"])
    assert [got[i] for i in range(3)] == tokens
    assert usage is not None and usage["completion_tokens"] == 24
    assert sorted(set(order)) == [0, 1, 2] and len(chunk_ids) == 1  # one response id
