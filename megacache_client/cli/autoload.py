"""`megacache autoload install|remove`: the zero-code hook for this environment.

Copies the `.pth` line the wheel ships (`megacache_autoload.pth`) into site-packages, so
every Python process with MEGACACHE_URL set uses the cache once it imports torch (`torchrun`
workers included), or removes it. Nothing here talks to a server.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

from megacache_client.config import ConfigError


def cmd_autoload(args: argparse.Namespace) -> int:
    source = Path(__file__).resolve().parents[2] / "megacache_autoload.pth"
    if not source.exists():
        raise ConfigError(f"{source} is missing: reinstall megacache (the wheel ships it)")
    text = source.read_text()
    target = Path(args.target or sysconfig.get_paths()["purelib"]) / "megacache_autoload.pth"
    if args.action == "install":
        target.write_text(text)
        print(f"installed {target}: processes with MEGACACHE_URL set now use the cache")
    else:
        target.unlink(missing_ok=True)
        print(f"removed {target}")
    return 0
