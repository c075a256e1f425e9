"""Hypothesis-generated requests against a real master process.

Well-formed frames carrying every master method with random parameters, and
truncated frames, must each get an error answer (or a clean close); the
master keeps serving a good client and its catalog stays consistent.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from clusterhelpers import Cluster, start_cluster, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from poolhelpers import make_keys, payload

import kvpool
from kvpool.cluster import wire as protocol
from kvpool.errors import CallTimeoutError, ConnectionLostError, KVPoolError
from kvpool.rpc import RpcClient, encode_frame
from kvpool.rpc.messages import Hello, Request, encode_envelope

METHODS = [
    getattr(protocol, n)
    for n in dir(protocol)
    if n.isupper() and "_" not in n[:1] and not n.startswith("EVENT_")
]
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.binary(max_size=20)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = start_cluster(["4MiB"])
    yield c
    c.stop()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(method=st.sampled_from([m for m in METHODS if isinstance(m, str)]), params=values)
def test_random_params_get_errors_not_crashes(
    cluster: Cluster, method: str, params: object
) -> None:
    with RpcClient(cluster.master.address, timeout=5) as client:
        try:
            client.call(method, params)
        except (ConnectionLostError, CallTimeoutError):
            raise  # the master must answer, not hang up or hang
        except KVPoolError:
            pass  # an error answer is the expected outcome for garbage


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.integers(1, 60), method=st.sampled_from(["keys.exists", "put.allocate"]))
def test_truncated_frames_are_dropped(cluster: Cluster, cut: int, method: str) -> None:
    hello = encode_frame(encode_envelope(Hello(version=1, name="fuzz")))
    request = encode_frame(encode_envelope(Request(1, method, {"keys": [b"x" * 16] * 3})))
    with socket.create_connection((cluster.master.host, cluster.master.port), timeout=5) as s:
        s.sendall(hello + request[: max(1, len(request) - cut)])
        s.shutdown(socket.SHUT_WR)
        s.settimeout(5)
        while True:
            try:
                if not s.recv(65536):
                    break
            except ConnectionResetError:
                break


def test_master_still_serves_after_the_fuzzing(cluster: Cluster) -> None:
    with kvpool.connect(cluster.url) as pool:
        assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
        keys = make_keys(3)
        assert pool.put_batch(keys, [payload(i) for i in range(3)]) == [True] * 3
        assert pool.prefix_match(keys) == 3
        assert pool.get(keys[1]) == payload(1).tobytes()
        for node_id, node in pool.stats()["nodes"].items():  # no bogus node got in
            assert node["capacity_bytes"] == 4 << 20, node_id
