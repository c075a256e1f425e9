"""The master's heartbeat replies carry the catalog's node events in their wire form.

The catalog queues typed events; nodes (and nodes of older releases) read
plain lists: ["commit", key, offset, size, parent, alloc_id],
["free", offset, alloc_id], ["ssd_drop", key]. This pins that wire shape.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from poolhelpers import make_keys

from kvpool.cluster.master import Master, MasterConfig
from kvpool.cluster.master.nodes import event_wire
from kvpool.cluster.master.puts import PutHandlers
from kvpool.cluster.wire import (
    ALLOCATE,
    COMMIT,
    HEARTBEAT,
    REGISTER,
    REMOVE,
    AllocateReply,
    AllocateRequest,
    CommitRequest,
    Heartbeat,
    HeartbeatReply,
    KeysRequest,
    RegisterNode,
)
from kvpool.errors import NotLeaderError
from kvpool.index.catalog import BlockCommitted, RangeFreed, SsdCopyDropped
from kvpool.rpc.client import RpcClient
from kvpool.transport.base import RegionInfo

PAGE = 4096


def test_each_event_has_its_wire_list() -> None:
    key, parent = make_keys(2)
    committed = BlockCommitted(key, 8192, 100, parent, 77)
    assert event_wire(committed) == ["commit", key, 8192, 100, parent, 77]
    assert event_wire(RangeFreed(4096, 77)) == ["free", 4096, 77]
    assert event_wire(SsdCopyDropped(key)) == ["ssd_drop", key]


@pytest.fixture
def master() -> Iterator[Master]:
    m = Master(MasterConfig(port=0, reap_interval=60.0))
    m.start()
    yield m
    m.close()


def test_heartbeats_replay_commits_and_frees_once_in_order(master: Master) -> None:
    keys = make_keys(2)
    with RpcClient(master.address, timeout=5, name="kvpool-node n1") as rpc:
        rpc.call(REGISTER, RegisterNode(RegionInfo(node_id="n1", size=4 * PAGE)))
        reply = rpc.call(
            ALLOCATE,
            AllocateRequest(keys, [PAGE, PAGE], [None, keys[0]]),
            response_type=AllocateReply,
        )
        ids = [p[0][0] for p in reply.placements if p]
        offsets = [p[0][2] for p in reply.placements if p]
        assert rpc.call(COMMIT, CommitRequest(ids)) == [True, True]
        assert rpc.call(REMOVE, KeysRequest(keys[:1])) == [True]
        beat = rpc.call(HEARTBEAT, Heartbeat("n1"), response_type=HeartbeatReply)
        assert beat.known
        assert beat.events == [
            ["commit", keys[0], offsets[0], PAGE, None, ids[0]],
            ["commit", keys[1], offsets[1], PAGE, keys[0], ids[1]],
            ["free", offsets[0], ids[0]],
        ]
        again = rpc.call(HEARTBEAT, Heartbeat("n1"), response_type=HeartbeatReply)
        assert again.known and again.events == []
        stranger = rpc.call(HEARTBEAT, Heartbeat("n2"), response_type=HeartbeatReply)
        assert not stranger.known


def test_an_allocation_after_its_term_ended_is_sent_to_the_leader(master: Master) -> None:
    """A call that passed the term's gate just before the term ended (the master was
    deposed: no epoch, an empty catalog) is answered NotLeaderError, which callers
    follow to the leader, never "pool full" from the emptied catalog."""
    keys = make_keys(1)
    with RpcClient(master.address, timeout=5, name="kvpool-node n1") as rpc:
        rpc.call(REGISTER, RegisterNode(RegionInfo(node_id="n1", size=4 * PAGE)))
    master.state.epoch = 0  # what the master's deposal leaves (Master._begin_term(0))
    with pytest.raises(NotLeaderError):
        PutHandlers(master.state).allocate(AllocateRequest(keys, [PAGE], [None]))


def test_a_node_of_an_older_release_registers_its_blocks_as_confirmed(master: Master) -> None:
    """Rows without the ``confirmed`` flag (older nodes) are restored as before: every
    block, none refused; a second block of a key on the node is still refused."""
    keys = make_keys(2)
    rows = [[keys[0], 0, PAGE, None, None], [keys[1], PAGE, PAGE, None, None]]
    rows.append([keys[0], 2 * PAGE, PAGE, None, None])
    with RpcClient(master.address, timeout=5, name="kvpool-node n1") as rpc:
        region = RegionInfo(node_id="n1", size=4 * PAGE)
        reply = rpc.call(REGISTER, RegisterNode(region, rows, rejoin=True))
    assert reply["restored"] == 2 and reply["refused"] == [2 * PAGE]
    assert master.state.catalog.exists(keys) == [True, True]
