"""Page-locking host memory for CUDA copies (``cudaHostRegister``), outcome reported.

A host range registered with CUDA is page-locked: copies between it and GPU
memory are DMA transfers at full link speed, with no hidden staging copy
through a driver-owned pinned buffer. kvpool registers its DRAM arena (the
node or embedded pool that creates it) and the mapping a same-host client
makes of a node's arena (``kvpool.transport.shm``).

Registration is best effort and never silent: without an NVIDIA driver or a
CUDA build of torch, when turned off, or when CUDA refuses (the memlock
limit, a range registered twice, ...) the memory stays pageable, copies
still work (more slowly), and ``PageLock.status`` says which case it was.
``stats()`` reports that string, so a slow GPU copy can be traced to it.

Status strings (stable, for people and dashboards): ``registered``;
``off: ...`` (``page_lock=False`` or ``KVPOOL_PAGE_LOCK=0``);
``unavailable: ...`` (no driver, no torch, no CUDA device); ``failed: ...``
(CUDA's error code and string); ``released`` after ``release()``.

Invariant: a registered range is unregistered (``release``) before it is
unmapped; unmapping registered memory leaves CUDA with dangling pages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# cudaHostRegisterPortable: the range counts as pinned for every CUDA context
# (every GPU), not only the one current when it was registered.
_PORTABLE = 1
ENV_SWITCH = "KVPOOL_PAGE_LOCK"


@dataclass
class PageLock:
    """The outcome of registering ``[address, address + size)`` with CUDA."""

    address: int
    size: int
    status: str
    _cudart: Any = field(default=None, repr=False)

    @property
    def registered(self) -> bool:
        return self.status == "registered"

    def release(self) -> None:
        """Unregister the range (before it is unmapped). Idempotent."""
        if self.registered and self._cudart is not None:
            self._cudart.cudaHostUnregister(self.address)
            self.status = "released"
            self._cudart = None


def page_lock(address: int, size: int, *, enabled: bool = True) -> PageLock:
    """Register ``size`` bytes at ``address`` with CUDA; never raises.

    ``enabled=False`` (or ``KVPOOL_PAGE_LOCK=0`` in the environment) skips
    registration and says so in the status.
    """
    if not enabled:
        return PageLock(address, size, "off: disabled by configuration (page_lock=False)")
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return PageLock(address, size, f"off: {ENV_SWITCH}={os.environ[ENV_SWITCH]}")
    if size <= 0:
        return PageLock(address, size, "unavailable: empty range")
    cudart, why = cuda_runtime()
    if cudart is None:
        return PageLock(address, size, f"unavailable: {why}")
    try:
        err = cudart.cudaHostRegister(address, size, _PORTABLE)
    except Exception as exc:  # a binding without the call, or a driver error
        return PageLock(address, size, f"failed: cudaHostRegister raised {exc!r}")
    code = int(err)
    if code != 0:
        why = f"failed: cudaHostRegister returned {code} ({_error_string(cudart, err)})"
        return PageLock(address, size, why)
    return PageLock(address, size, "registered", cudart)


def _error_string(cudart: Any, err: Any) -> str:
    # torch's binding names only cudaSuccess in its enum; the runtime names the rest.
    try:
        return str(cudart.cudaGetErrorString(err))
    except Exception:
        return "no error string"


def cuda_runtime() -> tuple[Any, str]:
    """torch's CUDA runtime bindings, or None and the reason they are not usable.

    Without an NVIDIA driver there is no point importing torch (about a
    second of start-up), so the driver is looked for first.
    """
    if not os.path.exists("/proc/driver/nvidia"):
        return None, "no NVIDIA driver (/proc/driver/nvidia is absent)"
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} sees no CUDA device"
    return torch.cuda.cudart(), ""
