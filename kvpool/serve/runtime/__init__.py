"""The torch side of ``kvpool serve``.

- ``model``, ``tokenizer``: the decoder (deterministic random weights, or a
  checkpoint's) and the byte tokenizer;
- ``checkpoint/``: Hugging Face Llama-family checkpoints (config checks,
  safetensors weights, tokenizer, chat template, namespace digest);
- ``sampling``: greedy or seeded temperature/top-k/top-p token choice;
- ``prefill``, ``decode``, ``kv_io``: the prefill worker, the continuous-batching
  decode engine, and per-layer KV between tensors and the pool (a ``KVStore``);
- ``workers`` (the worker process), ``worker_messages``, ``prefill_service``,
  ``decode_service``: the RPC side of the workers;
- ``pipeline``, ``pipeline_stage``: pipeline (chunked) prefill across workers;
- ``launcher``: the processes of one ``kvpool serve`` (master, node, workers,
  front end) and their start and stop;
- ``http/``: the OpenAI-compatible front end (completions, chat, stop
  conditions) and a load generator for it;
- ``calibrate``: ``kvpool calibrate`` (fits the conductor's cost model).
"""
