"""Every argument check kvpool shares, in one place.

Two kinds live here:

- **Store checks** (``check_key``, ``check_parent``, ``check_batch``,
  ``check_reserve_size``, ``check_read_range``/``block_range``,
  ``check_out_fits``, ``check_write_range``, ``data_region``, ``out_region``):
  the embedded pool and the cluster client call the same functions, so the
  same bad input raises the same error type with the same message on both
  stores. Each raises before any state changes.
- **Command-line types** (``size_arg``, ``sizes_arg``, ``address_arg``,
  ``pool_url_arg``, ``positive_int``, ...): argparse ``type=`` callables
  that parse sizes, addresses and URLs once and turn a bad value into
  argparse's one-line usage error (exit status 2), never a traceback.
"""

from __future__ import annotations

import argparse
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.bindings.buffers import Region, as_region, plain_host, region_nbytes
from kvpool.config import parse_size
from kvpool.errors import BufferSpecError, InvalidKeyError
from kvpool.index.keys import KEY_BYTES

# -- store checks -------------------------------------------------------------


def check_key(key: object, what: str = "key") -> None:
    if not isinstance(key, bytes):
        raise InvalidKeyError(
            f"{what} must be bytes of length {KEY_BYTES} (from kvpool.block_keys), "
            f"got {type(key).__name__}"
        )
    if len(key) != KEY_BYTES:
        raise InvalidKeyError(f"{what} must be exactly {KEY_BYTES} bytes, got {len(key)}")


def check_parent(parent: object) -> None:
    if parent is not None:
        check_key(parent, what="parent")


def check_keys(keys: Sequence[bytes], parents: Sequence[bytes | None] | None = None) -> None:
    for key in keys:
        if type(key) is not bytes or len(key) != KEY_BYTES:  # a good key costs no call
            check_key(key)
    for parent in parents or ():
        check_parent(parent)


def data_region(data: Any) -> Region:
    """The readable region of a value to store; a block has at least one byte. A
    non-empty plain host array (``buffers.plain_host``) is one as it is (~0.16 us
    against ~1 us for the general view: a batch pays it per block)."""
    if plain_host(data) and data.nbytes:
        return data
    src = as_region(data, what="data")
    if region_nbytes(src) == 0:
        raise BufferSpecError("data is empty; a block must have at least one byte")
    return src


def out_region(out: Any) -> Region:
    """The writable region of a destination buffer."""
    return as_region(out, writable=True, what="out")


def check_batch(
    keys: Sequence[bytes],
    values: Sequence[Any],
    parents: Sequence[bytes | None] | None = None,
    *,
    what: str = "datas",
) -> list[bytes | None]:
    """Check a batch's lengths and keys; returns ``parents`` as a list (None-filled)."""
    filled: list[bytes | None] = list(parents) if parents is not None else [None] * len(keys)
    if not len(keys) == len(values) == len(filled):
        names = f"keys, {what} and parents" if parents is not None else f"keys and {what}"
        raise ValueError(
            f"{names} must have the same length, got {len(keys)}, {len(values)}"
            + (f" and {len(filled)}" if parents is not None else "")
        )
    check_keys(keys, filled if parents is not None else None)  # (None-filled: nothing to check)
    return filled


def check_reserve_size(size: object) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise BufferSpecError(f"size must be a positive int, got {size!r}")
    return size


def check_reserve_batch(
    keys: Sequence[bytes], sizes: Sequence[int], parents: Sequence[bytes | None] | None
) -> list[bytes | None]:
    """A ``reserve_batch``'s arguments; returns ``parents`` as a list (None-filled)."""
    filled = check_batch(keys, sizes, parents, what="sizes")
    for size in sizes:
        check_reserve_size(size)
    return filled


def check_read_range(offset: object, length: object) -> None:
    """A ranged read's arguments (the block's size is checked by the store)."""
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise BufferSpecError(f"bad range: offset must be an int >= 0, got {offset!r}")
    if length is not None and (
        isinstance(length, bool) or not isinstance(length, int) or length <= 0
    ):
        raise BufferSpecError(f"bad range: length must be a positive int or None, got {length!r}")


#: A batch read's (starts, lengths), one each per key (``check_read_ranges``).
Ranges = tuple[list[int], list[int | None]]


def check_read_ranges(
    n: int, offsets: Sequence[int] | None, lengths: Sequence[int | None] | None
) -> Ranges | None:
    """A batch read's ranges (``get_into_batch``): ``offsets`` and ``lengths`` hold one
    entry per key each (None: from byte 0, to the block's end), every pair checked
    as ``get_into``'s; both as lists, or None when neither is given (whole blocks)."""
    if offsets is None and lengths is None:
        return None
    try:
        starts = [0] * n if offsets is None else list(offsets)
        takes: list[int | None] = [None] * n if lengths is None else list(lengths)
    except TypeError:
        raise BufferSpecError(
            f"offsets and lengths must be sequences, got {offsets!r} and {lengths!r}"
        ) from None
    if not len(starts) == len(takes) == n:
        raise ValueError(
            f"offsets and lengths must hold one entry per key ({n}), "
            f"got {len(starts)} and {len(takes)}"
        )
    for start, take in zip(starts, takes, strict=True):
        check_read_range(start, take)
    return starts, takes


def check_write_range(offset: int, nbytes: int, size: int) -> None:
    """A piecewise write of ``nbytes`` at ``offset`` must lie inside a block of ``size``."""
    end = offset + nbytes
    if offset < 0 or end > size:
        raise BufferSpecError(f"write of [{offset}, {end}) is outside the block of {size}")


def block_range(offset: int, length: int | None, size: int) -> int:
    """Bytes a read of [offset, offset+length) takes from a block of ``size``.

    ``length=None`` means to the end of the block. A range past the block's
    end is a caller error (BufferSpecError), not a miss."""
    if offset >= size:
        raise BufferSpecError(f"offset {offset} is past the end of the {size}-byte block")
    take = size - offset if length is None else length
    if offset + take > size:
        raise BufferSpecError(
            f"range [{offset}, {offset + take}) is outside the block of {size} bytes"
        )
    return take


def check_out_fits(out: Region, nbytes: int) -> None:
    """``out`` must hold the ``nbytes`` a read copies into it."""
    have = region_nbytes(out)
    if have < nbytes:
        raise BufferSpecError(f"out has {have} bytes but {nbytes} are asked")


def check_client_options(
    timeout: float,
    lease_cache_s: float,
    lease_cache_bytes: int,
    contribute_dram: int,
    put_grant_bytes: int | None,
) -> None:
    """``kvpool.connect``'s numeric options, checked before anything connects: a
    ValueError naming the bad one (a socket's own "Timeout value out of range", or
    a lease cache that never holds, would come later and say less)."""
    if not 0 < timeout < math.inf:  # also refuses nan
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not 0 <= lease_cache_s < math.inf:
        raise ValueError(
            f"lease_cache_s must be >= 0 seconds (0: no lease cache), got {lease_cache_s!r}"
        )
    byte_counts = [("lease_cache_bytes", lease_cache_bytes), ("contribute_dram", contribute_dram)]
    if put_grant_bytes is not None:  # (None: $KVPOOL_PUT_GRANT_BYTES or the default)
        byte_counts.append(("put_grant_bytes", put_grant_bytes))
    for name, value in byte_counts:
        try:
            bad = isinstance(value, bool) or operator.index(value) < 0
        except TypeError:
            bad = True
        if bad:
            raise ValueError(f"{name} must be an integer >= 0 (bytes), got {value!r}")


# -- command-line types ---------------------------------------------------------


def _argtype(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name  # argparse names the type in its messages
    return convert


def _size(text: str) -> int:
    n = parse_size(text)
    if n <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return n


def _size_or_zero(text: str) -> int:
    return parse_size(text)


def _sizes(text: str) -> list[int]:
    sizes = [_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise ValueError(f"expected a comma-separated list of sizes, got {text!r}")
    return sizes


def parse_address(address: str | tuple[str, int]) -> tuple[str, int]:
    """``"host:port"``, ``"kvpool://host:port"`` or a tuple -> (host, port)."""
    if isinstance(address, tuple):
        return address[0], int(address[1])
    addr = address.removeprefix("kvpool://").rstrip("/")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _pool_url(text: str) -> str:
    if "://" in text and not text.startswith("kvpool://"):
        raise ValueError(f"expected kvpool://HOST:PORT, got {text!r}")
    host, port = parse_address(text)
    return f"kvpool://{host}:{port}"


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    """A parser of one integer >= ``low``; ``what`` names the expectation in errors."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"expected {what}, got {text!r}") from None
        if n < low:
            raise ValueError(f"expected {what}, got {text!r}")
        return n

    return parse


def _list_of(parse: Callable[[str], int], what: str) -> Callable[[str], list[int]]:
    """A parser of a comma-separated, non-empty list of what ``parse`` accepts."""

    def parse_list(text: str) -> list[int]:
        values = [parse(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise ValueError(f"expected a comma-separated list of {what}, got {text!r}")
        return values

    return parse_list


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _float_in(
    what: str, low: float, *, low_open: bool, high: float = math.inf
) -> Callable[[str], float]:
    """A parser of finite floats from ``low`` (excluded when ``low_open``) to ``high``
    (included when finite); its error says ``expected WHAT, got 'TEXT'``. Every float
    option goes through one: a bare ``float`` takes nan, inf and negative values."""

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise ValueError(f"expected {what}, got {text!r}") from None
        above = x > low if low_open else x >= low
        if not (above and x <= high and math.isfinite(x)):  # nan fails every comparison
            raise ValueError(f"expected {what}, got {text!r}")
        return x

    return parse


_share = _float_in("a share from 0 to 1", 0.0, low_open=False, high=1.0)
_seconds = _float_in("a positive number of seconds", 0.0, low_open=True)
_positive_float = _float_in("a positive number", 0.0, low_open=True)
_non_negative_float = _float_in("a number >= 0", 0.0, low_open=False)


def _port(text: str) -> int:
    n = _non_negative_int(text)
    if n > 65535:
        raise ValueError(f"a port is 0-65535, got {text!r}")
    return n


#: "4GiB", "512MiB", "4096" -> bytes (> 0).
size_arg = _argtype("size", _size)
#: Like ``size_arg`` but 0 is allowed (a capacity that can be off).
size_or_zero_arg = _argtype("size", _size_or_zero)
#: "64KiB,1MiB" -> [65536, 1048576].
sizes_arg = _argtype("sizes", _sizes)
#: "host:port" -> (host, port).
address_arg = _argtype("address", parse_address)
#: "kvpool://host:port" or "host:port" -> "kvpool://host:port".
pool_url_arg = _argtype("pool URL", _pool_url)
positive_int = _argtype("positive int", _positive_int)
non_negative_int = _argtype("int >= 0", _non_negative_int)
port_arg = _argtype("port", _port)
#: "0.25" -> 0.25 (a fraction from 0 to 1).
share_arg = _argtype("share", _share)
#: "2.5" -> 2.5 (a positive, finite number of seconds).
seconds_arg = _argtype("seconds", _seconds)
#: "1.5" -> 1.5 (finite, > 0): rates, factors, SLO multiples.
positive_float = _argtype("positive number", _positive_float)
#: "0" -> 0.0 (finite, >= 0): thresholds that may be off.
non_negative_float = _argtype("number >= 0", _non_negative_float)


#: "512,1024" -> [512, 1024] (each > 0, at least one).
positive_ints = _argtype("positive ints", _list_of(_positive_int, "positive integers"))
#: "0,4096" -> [0, 4096] (each >= 0, at least one).
non_negative_ints = _argtype("ints >= 0", _list_of(_non_negative_int, "integers >= 0"))
