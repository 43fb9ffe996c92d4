"""Compiled output meant for one rank: bound to it, never loaded by another.

Every rank of a job publishes what its entry lacks, so an entry holds the graphs of every
pipeline stage and model-parallel rank that compiles under its key. torch's cache keys do
not cover the rank, while the compiled output can depend on it:

- `precompile` (Dynamo output): keyed by the function's name and first line; Dynamo bakes
  `dist.get_rank()`, `get_world_size()` and a group's ranks into its bytecode and graph
  with no guard. Bound, in a job of more than one rank.
- `inductor` (FX graph) and `aot_autograd`: keyed by the graph (its constants included)
  and the settings, not the rank; Inductor's lowering of a collective can write
  rank-specific code (pytorch/pytorch#188332) or a group's name (#189330) that the graph
  does not show. Bound when its code calls a collective.
- `pgo` (automatic-dynamic profiles): another rank's says only which dimensions are
  dynamic, never a wrong result. Shared.
- kernels (packs): a kernel is its source. Shared.

A bound artifact is named in its bundle's meta (`rank_bound`, "<rank>/<world size>" to the
artifact keys of that position); a process at another position withholds it from torch
(it compiles that graph itself: a miss, never another rank's code) and keeps it in any
entry it republishes. Positions are a rank and a world size because a stage is a function
of both: the same rank of a job of another size may run another stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from megacache_client.job import JobIdentity
from megacache_client.torch import megacache_io

META = "rank_bound"
MAX_META = 4096
"""The server's bound on one meta value: artifacts whose binding does not fit are not
shipped (a binding left out would let every rank load them)."""
KEY_CHARS = 24
"""Enough of an artifact key to name it in a bundle (keys are 50-64 characters)."""
COLLECTIVE_MARKERS = (b"_c10d_functional", b"ops.c10d.", b"c10d::", b"_functional_collectives",
                      b"ops._dtensor.")
"""Bytes that only the code of a graph calling a collective holds (every Inductor output
names `torch._C._distributed_c10d` in its preamble, so that name alone says nothing)."""
BOUND_KINDS = ("precompile", "inductor", "aot_autograd")
RIDERS = ("precompile", "pgo")
"""Artifacts that ride with compiled graphs and never justify an upload alone: precompiled
Dynamo output (another rank's package of the same function would only replace the
entry's), and automatic-dynamic profiles, which torch keys by the rank itself (each rank
of a data-parallel job has its own, saying the same)."""

Key = tuple[str, str]
"""(artifact type, artifact key)."""


def position(job: JobIdentity | None = None) -> str:
    """This process's place in its job: "<rank>/<world size>" ("0/1" alone)."""
    job = job if job is not None else JobIdentity.of_process()[0]
    return f"{job.rank}/{job.world_size}"


def bound(artifacts: megacache_io.Artifacts, where: str) -> set[Key]:
    """The artifacts of this process that only its own position may load."""
    alone = where.endswith("/1")
    out: set[Key] = set()
    for kind in BOUND_KINDS:
        for a in artifacts.get(kind, []):
            if (not alone) if kind == "precompile" else _calls_collective(a.content):
                out.add((kind, a.key))
    return out


def _calls_collective(content: object) -> bool:
    data = bytes(content) if isinstance(content, (bytes, bytearray, memoryview)) else b""
    return any(marker in data for marker in COLLECTIVE_MARKERS)


def parse(meta: Mapping[str, str]) -> dict[str, set[str]]:
    """A bundle's bindings: position -> the short keys ("<kind>:<key prefix>") bound there."""
    out: dict[str, set[str]] = {}
    for part in meta.get(META, "").split(";"):
        where, _, keys = part.partition("=")
        if where and keys:
            out.setdefault(where, set()).update(k for k in keys.split(",") if k)
    return out


def short(key: Key) -> str:
    return f"{key[0]}:{key[1][:KEY_CHARS]}"


def render(bindings: Mapping[str, Iterable[str]]) -> tuple[str, set[str]]:
    """Bindings as the meta value, and the short keys that did not fit (to leave out)."""
    parts: list[str] = []
    used, left = 0, set()
    for where in sorted(bindings):
        items: list[str] = []
        for item in sorted(bindings[where]):
            extra = len(item) + 1 + (0 if items else len(where) + 1)
            if used + extra > MAX_META:
                left.add(item)
                continue
            items.append(item)
            used += extra
        if items:
            parts.append(f"{where}=" + ",".join(items))
    return ";".join(parts), left


def withheld(artifacts: megacache_io.Artifacts, meta: Mapping[str, str], where: str) -> set[Key]:
    """The artifacts of a bundle bound to any position other than `where` (a key bound to
    two positions is withheld too: a bundle holds one artifact per key, whichever rank's
    it is)."""
    others = {k for pos, keys in parse(meta).items() if pos != where for k in keys}
    return {(kind, a.key) for kind, items in artifacts.items() for a in items
            if short((kind, a.key)) in others}


def restricted(meta: Mapping[str, str], keys: Iterable[Key]) -> dict[str, str]:
    """`meta` with its bindings cut to `keys` (the artifacts of its bundle that go on)."""
    shorts = {short(k) for k in keys}
    kept = {pos: {k for k in items if k in shorts} for pos, items in parse(meta).items()}
    value, _ = render({pos: items for pos, items in kept.items() if items})
    return {META: value} if value else {}


def merged(*metas: Mapping[str, str], ours: Iterable[Key] = (), where: str = ""
           ) -> dict[str, set[str]]:
    """The bindings of several bundles joined, with `ours` bound at `where`."""
    out: dict[str, set[str]] = {}
    for meta in metas:
        for pos, keys in parse(meta).items():
            out.setdefault(pos, set()).update(keys)
    mine = {short(k) for k in ours}
    if mine:
        out.setdefault(where, set()).update(mine)
    return out


def only(artifacts: megacache_io.Artifacts, keys: set[Key]) -> megacache_io.Artifacts:
    """The artifacts of `keys`."""
    return {kind: [a for a in items if (kind, a.key) in keys] for kind, items in
            artifacts.items()}


def less(artifacts: megacache_io.Artifacts, keys: set[Key]) -> megacache_io.Artifacts:
    """The artifacts not of `keys`."""
    return {kind: [a for a in items if (kind, a.key) not in keys] for kind, items in
            artifacts.items()}


def graphs_in(keys: Iterable[Key]) -> set[Key]:
    """The keys of compiled graphs among `keys` (what can make an upload worth it)."""
    return {k for k in keys if k[0] not in RIDERS}
