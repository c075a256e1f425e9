"""vLLM v1 KV connector: ``kvpool.bindings.vllm.KVPoolConnector``.

Load it with ``"kv_connector": "KVPoolConnector", "kv_connector_module_path":
"kvpool.bindings.vllm"`` (see ``connector.py`` and the README section "Use
kvpool from vLLM / SGLang"). ``vllm`` is imported only when the connector
class is asked for, so the planning and page code is importable without it.
"""

from __future__ import annotations

from typing import Any

from kvpool.bindings.vllm.counters import process_totals

__all__ = ["KVPoolConnector", "process_totals"]


def __getattr__(name: str) -> Any:
    if name in ("KVPoolConnector", "KVPoolMetadata", "KVPoolConnectorStats"):
        from kvpool.bindings.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
