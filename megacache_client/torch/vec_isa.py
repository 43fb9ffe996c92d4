"""Torch's CPU vector-ISA probe, run in the background while the first compile gets going.

Before Inductor loads its first C++ kernel (a cached one too) it asks which vector ISAs this
CPU and compiler support (`cpu_vec_isa.valid_vec_isa_list`, once per process): for each
candidate it finds a tiny probe library in its cache dir and starts a child Python to
`dlopen` it. Measured here: 1.1-1.4 s of every start, all of it on the trainer's thread
inside the first step, a warm local cache included; most of it is waiting for children.

Once a kernels pack is in place, the probes' libraries are on disk (the pack carries them:
they are `.so` files of Inductor's cache dir, keyed like any kernel), so the probe needs no
g++ and can run on a thread of its own while the trainer's thread loads the bundle and
imports Inductor. The first caller of torch's function then waits for that result instead
of probing again: `install` makes the function's first call one at a time (later calls hit
torch's own cache). Nothing is started without a kernels pack: the probe would then build
its libraries, which is torch's business on its own schedule (and a GPU job without C++
kernels never needs them). One case is left as it is: a CUDA job whose pack holds only
C++ wrapper libraries (`cpp_wrapper`), which Inductor loads without probing; its consumers
then build the probe libraries once per node with g++, on this thread, not the trainer's.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

log = logging.getLogger("megacache")

THREAD_NAME = "megacache-isa-probe"
_start_lock = threading.Lock()
_started = False
_probed_on: str | None = None
"""The thread on which torch's probe ran, once `install` watches it (None before)."""
_first_call = threading.Lock()
"""Held while torch's probe runs: a second caller waits for the first one's result."""


def _after_fork_in_child() -> None:
    """A child forked mid-probe (a DataLoader worker, say) must not inherit a held lock."""
    global _first_call
    _first_call = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def probed_on() -> str | None:
    """Name of the thread that ran torch's ISA probe in this process, if it was watched."""
    return _probed_on


def install() -> bool:
    """Serialise torch's ISA probe (idempotent); False when torch has none to serialise.

    Imports what the probe imports, here on the caller's thread: the background thread
    then imports nothing (importing torch modules on two threads at once broke a real job).
    """
    from torch._inductor import codecache, cpp_builder, cpu_vec_isa  # noqa: F401
    from torch.utils import _filelock, cpp_extension  # noqa: F401  (the builder's flags)

    original = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    if getattr(original, "__megacache_serialised__", False):
        return True
    if original is None or not callable(getattr(original, "cache_info", None)):
        return False  # not the cached function this module knows: leave torch alone

    @functools.wraps(original)
    def valid_vec_isa_list() -> Any:
        global _probed_on
        with _first_call:  # a probe in flight finishes; its result is then cached
            probing = original.cache_info().currsize == 0
            found = original()
            if probing:
                _probed_on = threading.current_thread().name
            return found

    valid_vec_isa_list.cache_clear = original.cache_clear  # type: ignore[attr-defined]
    valid_vec_isa_list.cache_info = original.cache_info  # type: ignore[attr-defined]
    valid_vec_isa_list.__megacache_serialised__ = True  # type: ignore[attr-defined]
    setattr(cpu_vec_isa, "valid_vec_isa_list", valid_vec_isa_list)  # noqa: B010 (not its type)
    return True


def probe_in_background() -> threading.Thread | None:
    """Start torch's ISA probe on a daemon thread, once per process; None if not started.

    Call only once a kernels pack is in place (see the module docstring). A failure is
    only logged: the trainer's own first call then probes as it would have.
    """
    global _started
    with _start_lock:
        if _started:
            return None
        try:
            if not install():
                return None
        except Exception as exc:  # an Inductor without this probe: nothing to overlap
            log.debug("megacache: no background ISA probe: %s", exc)
            return None
        _started = True
    thread = threading.Thread(target=_probe, name=THREAD_NAME, daemon=True)
    thread.start()
    return thread


def _probe() -> None:
    from torch._inductor import cpu_vec_isa

    try:
        cpu_vec_isa.valid_vec_isa_list()
    except Exception as exc:
        log.debug("megacache: background ISA probe failed: %s", exc)
