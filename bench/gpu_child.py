"""One section of ``kvpool bench gpu`` in its own process (``kvpool.bench.gpu_check`` starts it).

A section runs in a process of its own so that nothing it does can take
the others down: a crash in a native library (UCX, the CUDA driver), a
sticky CUDA error that poisons the process's context, or GPU memory it
leaves allocated all end with the process. The parent kills the process
when the section's budget is spent; because the section's record is
rewritten at every figure, check and skip (``Section.record_path``), what
it measured before it was killed is kept.

The section function is named by ``--target module:function`` and gets
``--inputs`` (JSON list) after the ``Section``; its outcome (``ok``,
``timeout`` when it noticed its own budget was spent, or ``error`` with the
traceback) is the record's ``status``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
import traceback

from kvpool.args import seconds_arg
from kvpool.bench.gpu_common import Section, SectionTimeout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpool.bench.gpu_child")
    p.add_argument("--name", required=True)
    p.add_argument("--target", required=True, help="module:function")
    p.add_argument("--inputs", default="[]", help="JSON list of the function's arguments")
    p.add_argument("--device", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--seconds", type=seconds_arg, required=True, help="the section's budget")
    p.add_argument("--record", required=True, help="where to keep the section's record (JSON)")
    args = p.parse_args(argv)

    s = Section(
        args.name,
        args.device,
        args.dry_run,
        time.monotonic() + args.seconds,
        lambda line: print(line, flush=True),
        record_path=args.record,
    )
    s.outcome["status"] = "running"
    s.save()
    try:
        module, _, function = args.target.partition(":")
        fn = getattr(importlib.import_module(module), function)
        fn(s, *json.loads(args.inputs))
        s.outcome["status"] = "ok"
    except SectionTimeout as exc:
        s.outcome.update(status="timeout", error=str(exc))
    except BaseException as exc:
        s.outcome.update(status="error", error=repr(exc), traceback=traceback.format_exc())
    s.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
