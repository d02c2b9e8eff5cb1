"""outbox_core is the neutral package: the SQL files are its package data, found with
importlib.resources, and the import contracts hold (outbox_core imports neither relay nor
consumer_sdk; the SDK never imports relay; the relay never imports the SDK's private modules).
ruff's banned-api rules enforce the named modules in `make lint`; this test catches any
private module, in every file (adapters are exempt from ruff's TID251 rules for psycopg)."""

from __future__ import annotations

import ast
from importlib.resources import files
from pathlib import Path

import consumer_sdk
import outbox_core
import relay
from outbox_core import queries

ROOT = Path(__file__).resolve().parents[3]


def _imports(package: object) -> list[tuple[Path, str]]:
    return _imports_under(Path(package.__file__).resolve().parent)  # type: ignore[attr-defined]


def _private_sdk_imports(package: object | Path) -> list[tuple[str, str]]:
    found = _imports_under(package) if isinstance(package, Path) else _imports(package)
    return [(p.name, m) for p, m in found
            if m.split(".")[0] == "consumer_sdk" and any(part.startswith("_") for part in m.split(".")[1:])]


def _imports_under(folder: Path) -> list[tuple[Path, str]]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(path, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found += [(path, f"{node.module}.{a.name}") for a in node.names]
    return found


def test_the_sql_files_live_in_the_package_and_are_found_as_resources() -> None:
    folder = queries.sql_files()
    assert Path(str(folder)) == ROOT / "outbox_core" / "sql"
    assert folder == files("outbox_core") / "sql"
    for sub in ("migrations", "queries", "roles", "adopt"):
        assert (folder / sub).is_dir(), sub
    assert not (ROOT / "sql").exists(), "one copy of the SQL files: outbox_core/sql/"
    assert queries.query("relay", "claim_batch").strip()


def test_outbox_core_imports_neither_relay_nor_the_sdk() -> None:
    bad = [(p.name, m) for p, m in _imports(outbox_core) if m.split(".")[0] in ("relay", "consumer_sdk")]
    assert bad == []


def test_the_sdk_never_imports_the_relay() -> None:
    assert [(p.name, m) for p, m in _imports(consumer_sdk) if m.split(".")[0] == "relay"] == []


def test_the_relay_never_imports_a_private_module_of_the_sdk() -> None:
    assert _private_sdk_imports(relay) == []


def test_the_contract_check_sees_every_form_of_a_private_import(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("from consumer_sdk import _pg\nimport consumer_sdk.jobs._db\n"
                                   "from consumer_sdk._pg import connect\nfrom consumer_sdk.jobs import admin\n")
    assert _private_sdk_imports(tmp_path) == [("m.py", "consumer_sdk._pg"), ("m.py", "consumer_sdk.jobs._db"),
                                              ("m.py", "consumer_sdk._pg.connect")]
