"""README's "Environment variables" table names every ``KVPOOL_*`` variable the code reads.

A variable only a module's docstring mentions is one a user cannot find: this keeps
the table whole (the shipped package and its benchmarks; ``KVPOOL_REQUIRE_*`` are
the test suite's own) and free of names nothing reads any more.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE_DIRS = ["kvpool", "index", "eviction", "transport", "bindings", "bench"]
NAME = re.compile(r"KVPOOL_[A-Z0-9_]+")


def _read_by_code() -> set[str]:
    names = set()
    for folder in SOURCE_DIRS:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".c"):
                names |= set(NAME.findall(path.read_text()))
    return {n for n in names if not n.startswith("KVPOOL_REQUIRE_")}


def _documented() -> list[str]:
    text = (ROOT / "README.md").read_text()
    start = text.index("### Environment variables")
    section = text[start : text.index("\n#", start + 1)]
    return re.findall(r"^\| `(KVPOOL_[A-Z0-9_]+)` \|", section, flags=re.M)


def test_the_readme_table_names_every_variable_the_code_reads() -> None:
    documented = _documented()
    assert len(documented) == len(set(documented)), "a variable is listed twice"
    read = _read_by_code()
    assert not read - set(documented), (
        f"read but not in README's table: {sorted(read - set(documented))}"
    )
    assert not set(documented) - read, (
        f"in README's table but read nowhere: {sorted(set(documented) - read)}"
    )
