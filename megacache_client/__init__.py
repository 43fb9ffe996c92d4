"""megacache client: load and publish torch.compile Mega-Cache bundles from a remote cache.

    import megacache_client
    megacache_client.enable(url="http://cache:8787", model="dlrm-v3", code=GIT_SHA)

or set MEGACACHE_URL (and optionally MEGACACHE_MODEL, MEGACACHE_CODE, ...) and let the
autoload hook do it in every process, `torchrun` workers included. Rank 0 of a job then
sends the job's progress too (steps, heartbeats, DCP checkpoints); a trainer that
checkpoints another way adds one line: `with megacache_client.checkpoint(): save(...)`.
`megacache_client.warm_up(model, batch)` compiles on a fast batch in the background while
the DataLoader's workers fill.

The names below are imported on first use, not with the package: the server imports
`megacache_client.wire` (the wire contract) and must not load the trainer's side with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megacache_client.api import (
        WarmUp,
        cached,
        checkpoint,
        checkpoint_loaded,
        checkpoint_saved,
        disable,
        enable,
        session,
        warm_up,
    )
    from megacache_client.config import ClientConfig
    from megacache_client.errors import MegacacheError
    from megacache_client.lifecycle import Session
    from megacache_client.wire.version import __version__

_WHERE = {"cached": "api", "checkpoint": "api", "checkpoint_loaded": "api",
          "checkpoint_saved": "api", "disable": "api", "enable": "api", "session": "api",
          "warm_up": "api", "WarmUp": "api",
          "ClientConfig": "config", "MegacacheError": "errors", "Session": "lifecycle",
          "__version__": "wire.version"}

__all__ = ["ClientConfig", "MegacacheError", "Session", "WarmUp", "cached", "checkpoint",
           "checkpoint_loaded", "checkpoint_saved", "disable", "enable", "session", "warm_up",
           "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'megacache_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"megacache_client.{_WHERE[name]}"), name)
    globals()[name] = value  # once: later lookups do not come here
    return value
