"""Discrete-event cluster simulator: the real conductor, index and eviction policies.

``kvpool sim TRACE --prefill 10 --decode 10`` serves a whole trace on a
simulated cluster of 8-GPU nodes (``cost_model.analytic_cluster``: the
llama2-70b shape on H100-class nodes; constants and sources there), with

- the real routing and admission code (``kvpool.serve.sched.conductor``: the
  conductor, the baseline routers, ``DecodeLoadPredictor``);
- the real index: every request's block keys are
  ``block_keys(tokens_for_request(record))`` (through
  ``kvpool.workload.cachesim.trace_keys``), so sharing is exactly what the
  pool would see — no stand-in for the hashing;
- the real eviction policies (``kvpool.eviction.make_policy``) for each
  node's share of the pool (``--capacity-blocks`` blocks per node), driven
  the way ``cachesim.simulate`` drives them.

Disaggregated mode (``--prefill P --decode D``): prefill nodes serve a FIFO
queue each (durations from the cost model, so the conductor's queue
estimate is the node's committed work); the first token leaves when the
prefill ends (TTFT); the KV then moves to the decode node with the most free
KV memory (transfer at the network bandwidth) and joins its continuous
batch, or waits for memory. Coupled mode (``--coupled N``): N nodes each run
prefill and decode; a prefill runs between two decode steps (prefill first,
as in vLLM's default scheduler), so it stalls the node's whole decode batch.
Modules: ``config`` (``SimConfig``, per-node and per-request state, event
kinds), ``decode_engine`` (a decode batch simulated per epoch), ``cluster``
(the event loop: arrival, prefill, transfer, decode), ``cpp`` (pipeline
prefill across k nodes, ``--cpp-group``: a ``Cluster`` subclass that changes
only the arrival step), ``runner`` (``simulate``: picks the class), ``cli``
(``kvpool sim``), ``cpp_cli`` (``kvpool sim-cpp``), ``report`` (the sweep
tables of the design notes).
"""
