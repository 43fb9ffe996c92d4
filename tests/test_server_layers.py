"""The server's layers, as the folders show them: `api` → `service` → `store`, never back.

`errors` and `settings` sit below all three; `cli` and `__main__` above them. The server may
import the client's wire contract (`megacache_client/wire/`) and nothing else of the client,
the wire contract imports nothing else of the client, the client never imports the server,
and no module imports itself back through others at import time.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from layers import import_cycles, imports, module_name

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "megacache_server"
CLIENT = ROOT / "megacache_client"

RANK = {"errors": 0, "settings": 0, "store": 1, "service": 2, "api": 3, "cli": 4,
        "__main__": 4, "": 4}
"""A module may import from its own rank or below."""
CLIENT_SHARED = {"wire"}
"""What the server takes from the client: the wire contract (`megacache_client/wire/`), and
nothing else of the client, so a change to the trainer's side cannot break the server."""


def _rank(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    return RANK[part]


def test_no_import_runs_upward():
    upward = []
    for path in sorted(SERVER.rglob("*.py")):
        module = module_name(path, SERVER)
        for name in imports(path, top_level_only=False):
            top, _, rest = name.partition(".")
            part = rest.split(".")[0]
            if (top == "megacache_server" and part in RANK and _rank(name) > _rank(module)) \
                    or (top == "megacache_client" and part not in CLIENT_SHARED):
                upward.append(f"{module} imports {name}")
    assert not upward, "\n".join(upward)


def test_the_client_never_imports_the_server():
    found = [f"{module_name(p, CLIENT)} imports {name}" for p in sorted(CLIENT.rglob("*.py"))
             for name in imports(p, top_level_only=False)
             if name.split(".")[0] == "megacache_server"]
    assert not found, "\n".join(found)


def test_the_wire_contract_imports_nothing_else_of_the_client():
    wire = CLIENT / "wire"
    found = [f"{module_name(p, CLIENT)} imports {name}" for p in sorted(wire.rglob("*.py"))
             for name in imports(p, top_level_only=False)
             if name.split(".")[0] == "megacache_client"
             and not name.startswith("megacache_client.wire.")]
    assert not found, "\n".join(found)


def test_importing_the_wire_contract_loads_no_other_clientmodule_name():
    """The package root is lazy: `import megacache_client.wire` (what every server module
    does) runs no module of the trainer's side, so none of them can break the server."""
    code = ("import sys, megacache_client.wire.manifest, megacache_client.wire.events, "
            "megacache_client.wire.signing, megacache_client.wire.routes; "
            "print(sorted(m for m in sys.modules if m.startswith('megacache_client.') "
            "and not m.startswith('megacache_client.wire')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True)
    assert r.stdout.strip() == "[]", r.stdout


def test_the_client_settings_the_server_knows_are_the_client_config():
    from dataclasses import fields

    from megacache_client.config import ClientConfig
    from megacache_client.wire.environment import CLIENT_SETTINGS

    assert tuple(f.name for f in fields(ClientConfig)) == CLIENT_SETTINGS


def test_no_import_cycles():
    cycles = import_cycles(SERVER)
    assert not cycles, "\n".join(cycles)
