"""Moving bytes between processes and hosts (installed as ``kvpool.transport``).

Same-host shared memory, UCX (UCXX) and a plain TCP fallback arrive with the
distributed pool; the embedded pool needs none of them.
"""
