"""Automatic transport choice: UCX only where an RDMA device exists at both ends.

The RDMA check reads the kernel's device list (/sys/class/infiniband); here
it is pointed at a temporary folder with and without a device entry. CUDA
alone never makes UCX the automatic choice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.transport import ucx
from kvpool.transport.base import RegionInfo, UcxInfo
from kvpool.transport.select import candidates


def _peer(rdma: bool) -> RegionInfo:
    info = RegionInfo("n", 1 << 20, "other-host", "127.0.0.1", 9, "")
    info.ucx = UcxInfo("127.0.0.1", 10, b"addr", rdma)
    return info


@pytest.fixture
def sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(ucx, "RDMA_SYSFS", str(tmp_path))
    return tmp_path


def test_no_rdma_device_means_no_ucx_even_with_cuda(
    sysfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not ucx.ucx_has_rdma()
    assert ucx.rdma_devices() == []
    assert candidates(_peer(rdma=True)) == ["shm", "tcp"]


def test_rdma_at_both_ends_puts_ucx_before_tcp(sysfs: Path) -> None:
    (sysfs / "mlx5_0").mkdir()
    assert ucx.rdma_devices() == ["mlx5_0"]
    assert ucx.ucx_has_rdma()
    assert candidates(_peer(rdma=True)) == ["shm", "ucx", "tcp"]
    # The node has no RDMA device: its UCX listener would run over TCP.
    assert candidates(_peer(rdma=False)) == ["shm", "tcp"]


def test_missing_sysfs_folder_means_no_rdma(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(ucx, "RDMA_SYSFS", str(tmp_path / "absent"))
    assert not ucx.ucx_has_rdma()


def test_an_explicit_choice_still_wins(sysfs: Path) -> None:
    assert candidates(_peer(rdma=False), override="ucx,tcp") == ["ucx", "tcp"]
