"""Smoke test of the data-path benchmark (one small size, one round)."""

from __future__ import annotations

from pathlib import Path

from kvpool.bench.remote_transport import run_remote_transport


def test_remote_transport_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    rows = run_remote_transport([64 << 10], ("tcp", "shm"), rounds=1, json_path=str(out))
    kinds = {(r.op, r.tier) for r in rows}
    assert kinds == {
        ("get_into", "tcp"),
        ("put", "tcp"),
        ("get_batch", "tcp"),
        ("get_into", "shm"),
        ("put", "shm"),
    }
    assert all(r.gbps > 0 and r.baseline_gbps > 0 for r in rows)
    assert out.read_text().startswith("[")


def test_raw_stream_baseline_sends_distinct_ranges() -> None:
    """The batch baseline moves the bytes a batch of reads moves: consecutive
    distinct ranges, not one (cache-hot) range again and again."""
    import socket
    import threading

    import numpy as np

    from kvpool.bench.remote_transport import RawClient, _raw_serve

    region = np.arange(4 * 256, dtype=np.uint32).view(np.uint8)  # every 4 bytes distinct
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        sock, _ = listener.accept()
        _raw_serve(sock, memoryview(region))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = RawClient("127.0.0.1", port)
    outs = [np.zeros(256, dtype=np.uint8) for _ in range(3)]
    client.stream(512, outs)
    for k, out in enumerate(outs):
        assert bytes(out) == bytes(region[512 + 256 * k : 512 + 256 * (k + 1)])
    client.sock.close()
    thread.join(timeout=5)
    listener.close()
