"""Hugging Face Llama-family checkpoints: config, safetensors weights, tokenizer.

- ``config``: ``read_checkpoint`` (every start-up check) and ``Checkpoint``;
- ``weights``: shards, tensor checks, loading a model's own layers;
- ``hf_tokenizer``: ``HFTokenizer`` over ``tokenizer.json``;
- ``identity``: the digest in the pool namespace.
"""
