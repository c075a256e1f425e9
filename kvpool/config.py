"""Configuration dataclasses, human-readable sizes ("4GiB", "512MiB"), environment
switches, and the optional compiled helpers they turn on or off."""

from __future__ import annotations

import importlib
import math
import os
import re
from dataclasses import dataclass
from types import ModuleType

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

DEFAULT_DRAM_BYTES = 256 << 20
# Where ``kvpool master`` listens, and the port a ``kvpool://host`` URL means.
# Here rather than in the master so that clients need not import it.
DEFAULT_PORT = 7480
DEFAULT_ALIGNMENT = 4096


def env_int(name: str, default: int, high: int) -> int:
    """An integer tuning knob from the environment, read by the caller once (at
    import): ``default`` when unset or blank; ValueError naming the variable
    when it is not an integer from 0 to ``high``."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= high:
        raise ValueError(f"${name} must be an integer from 0 to {high}, got {text!r}")
    return value


def env_seconds(name: str, default: float) -> float:
    """A duration knob from the environment, read by the caller once (at import):
    ``default`` when unset or blank; ValueError naming the variable when it is not
    a finite number of seconds >= 0."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:  # also refuses nan
        raise ValueError(f"${name} must be a number of seconds >= 0, got {text!r}")
    return value


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: an int, or a number with a unit (KiB, MiB, GiB, KB, MB, ...)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 64KiB, 1.5GiB, 10GB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


@dataclass(frozen=True)
class PoolConfig:
    """Capacities and policy of one embedded pool (or one storage node)."""

    dram_bytes: int = DEFAULT_DRAM_BYTES
    ssd_path: str | None = None
    ssd_bytes: int = 0
    gpu_bytes: int = 0
    policy: str = "lru"
    alignment: int = DEFAULT_ALIGNMENT
    # Register the DRAM arena with CUDA where CUDA is present (DMA-speed device
    # copies); False keeps it pageable. stats()["tiers"]["dram"]["page_lock"] tells.
    page_lock: bool = True

    def __post_init__(self) -> None:
        if self.dram_bytes < self.alignment:
            raise ValueError(f"dram_bytes must be >= {self.alignment}, got {self.dram_bytes}")
        if self.gpu_bytes < 0 or self.ssd_bytes < 0:
            raise ValueError("gpu_bytes and ssd_bytes must be >= 0")
        if (self.ssd_path is None) != (self.ssd_bytes == 0):
            raise ValueError("ssd_path and ssd_bytes go together: give both or neither")


def optional_extension(name: str, switch: str | None = None) -> tuple[ModuleType | None, str]:
    """The compiled module ``name`` (an optional extension: built where a C compiler was
    at install time), or None and why not: ``$switch=0`` turned it off, or it was not
    built. Imported by name: the compiled module, never a Python one."""
    if switch is not None and os.environ.get(switch, "1") == "0":
        return None, f"${switch}=0"
    try:
        return importlib.import_module(name), ""
    except ImportError as exc:
        return None, f"{name} not built: {exc}"
