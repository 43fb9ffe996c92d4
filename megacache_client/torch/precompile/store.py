"""torch's precompiled Dynamo cache, kept in a directory of this process's own.

torch (>= 2.8, `caching_precompile` on) keeps precompiled Dynamo output on local disk at
`<inductor cache dir>/dynamo/<key>`: `save_cache_artifacts` writes the process's own
packages there, `load_cache_artifacts` writes a bundle's there, and every `torch.compile`
of a process with caching precompile on loads and installs whatever it finds under the
compiled function's key (its qualified name and first line: every `nn.Sequential` shares
one), with no check of where it came from. An entry installed that way names globals by
its producer's unique-id counter (`__builtins_dict___0`, ...) while the process's own
counter starts at 0, so its first trace in the same module raises "Name
'__builtins_dict___0' already exists in scope" and the trainer dies. torch alone does the
same to the next process after any `save_cache_artifacts` (docs/precompiled-dynamo.md).

The client used to remove its entries when it closed; a process that ends without closing
(SIGTERM after its publish, SIGKILL, `os._exit`) left them for the next process on the
node. Now nothing the client does ever puts an entry where torch looks on its own: before
caching precompile is switched on, torch's one `DynamoCache` is pointed at
`<inductor cache dir>/megacache-dynamo/<pid>-<random>/`, a directory no other process
reads. Only this process's own output and the entries the client's gated load wrote (after
moving Dynamo's id counter past them) are ever there. The directory is held by an
exclusive `flock` for the life of the process (the kernel drops it however the process
ends, in any PID namespace) and removed at exit; one left by a process that died
is removed by the next process that enables the client on the node, once no lock is held
on it (SIGKILL and `os._exit` run no exit handler). If torch's cache cannot be
redirected, caching precompile stays off.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

ROOT_NAME = "megacache-dynamo"
OWNER = ".owner"
"""The lock file of a private directory: locked while its process lives."""
STRAY_AGE_S = 60.0
"""A directory with no lock file (its process died between making it and locking it) is
removed once it is this old, so a process still starting up keeps its own."""
ENTRY_NAME = re.compile(r"[0-9a-f]{64}")
"""torch's precompile keys: sha256 hex, one directory per compiled function."""

_private: Path | None = None
_owner_fd: int | None = None
_owner_pid: int | None = None


def torch_cache_dir() -> Path:
    """Inductor's cache dir, where torch keeps its own Dynamo cache (`<dir>/dynamo`)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def shared_dir() -> Path:
    """The directory torch itself reads precompiled entries from when left to itself."""
    return torch_cache_dir() / "dynamo"


def private_dir() -> Path | None:
    """This process's own Dynamo cache directory (None until `claim`)."""
    return _private if _owner_pid == os.getpid() else None


def claim() -> Path:
    """Point torch's Dynamo cache at a fresh directory of this process's own; raises when
    that cannot be done (a torch whose Dynamo cache is not `DiskDynamoCache`'s instance),
    so the caller leaves caching precompile off."""
    global _private, _owner_fd, _owner_pid
    found = private_dir()
    if found is not None:
        return found
    from torch._dynamo import package

    cache = package.DynamoCache
    if not callable(getattr(cache, "path_prefix", None)):
        raise RuntimeError("torch's DynamoCache has no path_prefix to redirect")
    root = torch_cache_dir() / ROOT_NAME
    root.mkdir(parents=True, exist_ok=True)
    sweep(root)
    path = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))
    fd = os.open(path / OWNER, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    target = str(path)
    cache.path_prefix = lambda: target  # type: ignore[method-assign]  # shadows the class's
    if cache.path_prefix() != target:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        raise RuntimeError("torch's DynamoCache did not take a directory of its own")
    if _owner_fd is not None:  # a forked child re-claims: the parent's lock is not ours
        with contextlib.suppress(OSError):
            os.close(_owner_fd)
    _private, _owner_fd, _owner_pid = path, fd, os.getpid()
    atexit.register(release)
    return path


def release() -> None:
    """Remove this process's directory, at exit (a forked child, which inherited the
    path, leaves its parent's alone). Entries stay there until then: they are this
    process's own, or ones its gated load admitted, and no other process reads them."""
    global _private, _owner_fd
    path = private_dir()
    if path is None:
        return
    shutil.rmtree(path, ignore_errors=True)
    if _owner_fd is not None:
        with contextlib.suppress(OSError):
            os.close(_owner_fd)
    _private, _owner_fd = None, None


def sweep(root: Path) -> int:
    """Remove the private directories under `root` whose process is gone: their lock is
    free (or, with no lock file, they are older than `STRAY_AGE_S`). Returns how many."""
    removed = 0
    try:
        children = list(root.iterdir())
    except OSError:
        return 0
    for child in children:
        if not child.is_dir() or child == private_dir():
            continue
        if _abandoned(child):
            shutil.rmtree(child, ignore_errors=True)
            removed += 1
    return removed


def _abandoned(path: Path) -> bool:
    try:
        fd = os.open(path / OWNER, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        with contextlib.suppress(OSError):
            return time.time() - path.stat().st_mtime > STRAY_AGE_S
        return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # its process holds it
    finally:
        os.close(fd)  # closing drops our lock too
    return True


def leftovers(where: Path | None = None) -> list[Path]:
    """Precompiled entries in torch's own Dynamo cache directory (left by torch alone, or
    by an earlier client that kept its entries there): never read by a process whose
    Dynamo cache `claim` redirected, listed so the client can say it ignores them."""
    where = where if where is not None else shared_dir()
    try:
        return sorted(p for p in where.iterdir()
                      if ENTRY_NAME.fullmatch(p.name) and (p / "entry").is_file())
    except OSError:
        return []
