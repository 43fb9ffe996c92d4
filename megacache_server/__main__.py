"""`megacache-server` and `python -m megacache_server`.

This module imports nothing beyond the client's base install until it knows the server's
dependencies are there: a client-only install (`pip install megacache`) still has the
`megacache-server` command, and it must say in one line what to install, not show a
traceback.
"""

from __future__ import annotations

import sys

from megacache_client.wire.exitcodes import ExitCode

#: top-level modules of the [server] extra
SERVER_MODULES = ("fastapi", "starlette", "uvicorn", "redis", "pydantic_settings",
                  "prometheus_client", "swagger_ui_bundle")


def main() -> int:
    try:
        from megacache_server.cli import main as cli_main
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in SERVER_MODULES:
            raise
        print(f"megacache-server: the server is not installed ({exc.name} is missing): "
              "pip install 'megacache[server]'", file=sys.stderr)
        return int(ExitCode.CONFIG)
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
