"""The layout stays readable: light ``import kvpool``, modules of readable size.

The import layers and the absence of cycles are checked by import-linter
(``.ci/layers``, contracts in pyproject.toml); these are the rules it cannot
express.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Folders that ship as the ``kvpool`` package (bench/ and tests/ are exempt).
PACKAGE_DIRS = ["kvpool", "index", "eviction", "transport", "bindings"]
#: "None over ~400 lines": a module past this is split along its concepts.
MAX_LINES = 400
#: What ``import kvpool`` must not load: the servers, their state, and heavy deps.
HEAVY = ("kvpool.cluster.master", "kvpool.index.catalog", "prometheus_client", "torch")


def test_import_kvpool_is_light() -> None:
    code = (
        "import kvpool, sys; "
        f"heavy = sorted(m for m in sys.modules if m.startswith({HEAVY!r})); "
        "print(','.join(heavy))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "", f"import kvpool loaded {done.stdout.strip()}"


def test_no_module_is_too_long() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for folder in PACKAGE_DIRS
        for path in (ROOT / folder).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_readme_layout_table_names_every_package() -> None:
    """The README's layout table stays true to the tree: each top folder and each
    folder of ``kvpool/`` has a row (a folder whose sub-folders all have rows, like
    ``kvpool/serve/``, may go without), and every deeper package is named in it."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Repository layout") :].split("\n\n")[2]
    rows = {line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]}
    packages = {
        init.parent.relative_to(ROOT).as_posix() + "/"
        for folder in PACKAGE_DIRS
        for init in (ROOT / folder).rglob("__init__.py")
    }
    for package in sorted(packages):
        depth = package.count("/")
        needs_row = depth == 1 or (depth == 2 and package.startswith("kvpool/"))
        children = {p for p in packages if p.startswith(package) and p.count("/") == depth + 1}
        if package in rows or (children and children <= rows):
            continue
        if needs_row:
            raise AssertionError(f"README layout table has no row for {package}")
        assert f"`{package.split('/')[-2]}/`" in table, f"README table never names {package}"
    for folder in ("index/", "eviction/", "transport/", "bindings/", "bench/", "tests/"):
        assert folder in rows


def test_a_command_loads_only_its_own_module() -> None:
    """``kvpool node`` / ``kvpool master`` start without the serving, simulation and
    benchmark code (every cluster test and every user's node pays that start-up)."""
    code = (
        "import sys; from kvpool.cli import build_parser; build_parser('node'); "
        "print(','.join(sorted(m for m in sys.modules "
        "if m.startswith(('kvpool.serve', 'kvpool.bench', 'kvpool.workload')))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""
