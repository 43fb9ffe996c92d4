"""Compiled kernels usable wherever torch is installed: identities without paths.

Inductor names a CPU kernel `.so` (and a precompiled header `.gch`) by a hash of its source
and its g++ command line, and that command line holds torch's and Python's absolute install
paths (`-I<torch>/include`, `-L<torch>/lib`, ...). A consumer whose torch lives elsewhere
computes other names, never finds the shipped files, and runs g++ for every kernel.

So each shipped file travels with an *identity*: a hash of its source and its flags with
those install paths replaced by placeholders (and, for headers, without the hash of the
preprocessed header text, which is full of paths). The `KeyRecorder` sits in torch's own
key function (`codecache.write`, which every kernel and header goes through before torch
checks whether it must compile): it records the identity of each name torch computes here,
and when torch asks for a name that is missing locally but whose identity arrived in a pack,
it places the shipped file under torch's local name. The key is thus always derived by torch
itself, from this machine's flags; a file is only found under flags equal to the producer's
up to install paths.

What the flags do not show (the compiler's version, the CPU `-march=native` resolves to, the
torch build) is compared by `refusal()` before a pack is used: a mismatch refuses the pack.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import sysconfig
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from megacache_client.wire.text import as_text

INDEX_FORMAT = 1
ARTIFACT_SUFFIXES = (".so", ".gch")
"""Files that are compiled output: what a consumer would otherwise have to build."""
BUILD_META_PREFIX = "build."
_PREPROCESSED_HASH = re.compile(r"[0-9a-f]{128}(?![0-9a-f])")


# -- what the flags do not show -----------------------------------------------------------

@functools.cache
def build_facts() -> dict[str, str]:
    """What a compiled kernel depends on beyond its source and flags, never a path.

    `march` is what g++'s `-march=native` (in Inductor's flags) resolves to on this CPU:
    two hosts with the same torch ISA level can still differ in it.
    """
    import torch

    from megacache_client.torch import env as torch_env

    facts = {
        "arch": platform.machine(),
        "isa": str(torch.backends.cpu.get_cpu_capability()).lower(),
        "march": _native_march() or "unknown",
        "cxx": torch_env.cxx_version() or "unknown",
        "torch": str(torch.__version__),
        "torch_git": str(getattr(torch.version, "git_version", "") or "unknown"),
    }
    # a compiler's banner is its text, not ours: blob meta values follow the text rule
    return {k: as_text(v, 256) for k, v in facts.items()}


def build_meta() -> dict[str, str]:
    """`build_facts()` as blob meta entries (`build.<fact>`)."""
    return {BUILD_META_PREFIX + k: v for k, v in build_facts().items()}


def refusal(meta: Mapping[str, str], ours: Mapping[str, str] | None = None) -> str:
    """Why a pack built with `meta`'s facts must not be used here ('' when it may be).

    A pack without build facts predates relocation: it is refused unless it was made by a
    torch at this very path (its kernel names are only valid there anyway).
    """
    ours = build_facts() if ours is None else ours
    theirs = {k[len(BUILD_META_PREFIX):]: v for k, v in meta.items()
              if k.startswith(BUILD_META_PREFIX)}
    if not theirs:
        from megacache_client.torch.env import torch_prefix

        prefix = meta.get("torch_prefix")
        if prefix and prefix != torch_prefix():
            return (f"pack from an older client, made with torch at {prefix} (here: "
                    f"{torch_prefix()}); its kernel names are only valid there")
        return ""
    differ = [f"{k} {theirs.get(k)!r} (here {v!r})" for k, v in sorted(ours.items())
              if theirs.get(k) != v]
    if differ:
        return ("compiled for another build: " + "; ".join(differ)
                + "; loading it could crash or miscompute, so these kernels are rebuilt here")
    return ""


@functools.cache
def _native_march() -> str | None:
    from megacache_client.torch.env import compiler_output

    out = compiler_output("-march=native", "-Q", "--help=target") or ""
    found = re.search(r"^\s*-march=\s+(\S+)", out, re.MULTILINE)
    return found.group(1) if found else None


# -- identities -----------------------------------------------------------------------------

def _torch_dir() -> str:
    import torch

    return os.path.dirname(torch.__file__)


@functools.cache
def install_paths() -> tuple[tuple[str, str], ...]:
    """(placeholder, path) pairs for the install paths Inductor puts in its flags.

    The same sources cpp_builder reads: torch's package dir (its include and lib dirs are
    inside), Python's include dirs and LIBDIR. Longest first, so a path inside another is
    replaced before its parent. Nothing broader (no bare prefix like /usr), so a flag that
    names some other directory never becomes equal to a different one.
    """
    pairs = {
        "@TORCH@": _torch_dir(),
        "@PY_INCLUDE@": sysconfig.get_path("include"),
        "@PY_INCLUDE_POSIX@": sysconfig.get_path("include", scheme="posix_prefix"),
        "@PY_LIBDIR@": sysconfig.get_config_var("LIBDIR"),
    }
    found: list[tuple[str, str]] = []
    for name, path in pairs.items():
        if not path:
            continue
        for variant in {str(path), os.path.realpath(path)}:
            if len(variant) > 1 and all(variant != p for _, p in found):
                found.append((name, variant))
    return tuple(sorted(found, key=lambda pair: -len(pair[1])))


def canonical(text: str, paths: Iterable[tuple[str, str]] | None = None) -> str:
    """`text` with every install path replaced by its placeholder."""
    for name, path in install_paths() if paths is None else paths:
        text = text.replace(path, name)
    return text


def identity(content: str | bytes, extension: str, extra: str,
             paths: Iterable[tuple[str, str]] | None = None) -> str:
    """The path-free identity of what torch keys as (content, extension, extra).

    Header keys also hash the preprocessed header text, which lists every include path;
    that hash is dropped (the build facts stand for the headers' content instead).
    """
    flags = canonical(extra, paths)
    if extension == "h":
        flags = _PREPROCESSED_HASH.sub("@PREPROCESSED@", flags)
    body = content.strip() if isinstance(content, str) else content.strip().decode("utf-8",
                                                                                  "replace")
    doc = json.dumps([INDEX_FORMAT, extension, body, flags], separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()


def artifact_of(extension: str, path: str) -> str | None:
    """The compiled file torch builds from the source it wrote at `path`, if any."""
    if extension == "main.cpp":
        return path[: -len(".cpp")] + ".so"
    if extension == "h":
        return path + ".gch"
    return None


def index_bytes(ids: Mapping[str, str]) -> bytes:
    """The pack index: shipped name -> identity, plus the build facts it was made with."""
    return json.dumps({"format": INDEX_FORMAT, "build": build_facts(), "files": dict(ids)},
                      sort_keys=True).encode()


def parse_index(raw: bytes | None) -> dict[str, str]:
    """Shipped name -> identity from a pack index (empty for a pack without one)."""
    from megacache_client.torch.packs import PackError, safe_name

    if raw is None:
        return {}
    try:
        doc = json.loads(raw)
        files = doc["files"]
        if doc.get("format") != INDEX_FORMAT or not isinstance(files, dict):
            raise ValueError("unknown index format")
        # a name is where a shipped file will be looked for: `../` would point outside
        # the unpacked pack, at any file the trainer can read, to be linked in as a kernel
        return {safe_name(str(k)): str(v) for k, v in files.items()
                if re.fullmatch(r"[0-9a-f]{64}", str(v))}
    except (ValueError, KeyError, TypeError) as exc:
        raise PackError(f"pack index is malformed: {exc}") from None


# -- the recorder inside torch's key function ---------------------------------------------

class KeyRecorder:
    """Learns the identity of each kernel/header name torch computes, places shipped ones.

    `records` maps a local file path to its identity (from torch's own calls, or from the
    index of a pack unpacked here); `available` maps an identity to a shipped file on disk.
    """

    def __init__(self) -> None:
        self.records: dict[str, str] = {}
        self.available: dict[str, str] = {}
        self.placed = 0
        self._lock = threading.Lock()
        self._original: Any = None
        self._before_header: Callable[[], None] | None = None
        self._pid = os.getpid()

    def install(self) -> None:
        """Wrap torch's `codecache.write` (idempotent). A failure here only costs relocation."""
        from torch._inductor import codecache

        with self._lock:
            if self._original is not None:
                return
            original = codecache.write
            self._original = original

            @functools.wraps(original)
            def write(content: Any, extension: str, extra: str = "", *args: Any,
                      **kwargs: Any) -> Any:
                if extension == "h":
                    self._hold_header()
                result = original(content, extension, extra, *args, **kwargs)
                with contextlib.suppress(Exception):  # never let bookkeeping break torch
                    self.seen(content, extension, extra, result[1])
                return result

            codecache.write = write

    def hold_headers(self, wait: Callable[[], None]) -> bool:
        """Run `wait` each time torch is about to name a precompiled header, the step before
        it checks whether it must build one; False when the recorder is not in torch.

        Inductor precompiles its header before it loads any C++ kernel, a cached one too,
        after a preprocessor pass of ~1 s: a toolchain pack still being unpacked can finish
        during all the loading before it, where a wait at the load would only add to it.
        """
        with self._lock:
            if self._original is None:
                return False
            self._before_header = wait
            return True

    def _hold_header(self) -> None:
        wait = self._before_header
        if wait is None or os.getpid() != self._pid:  # a forked compile worker: no pack here
            return
        with contextlib.suppress(Exception):  # never let the wait break torch
            wait()

    def uninstall(self) -> None:
        from torch._inductor import codecache

        with self._lock:
            if self._original is not None:
                codecache.write = self._original
                self._original = None

    def seen(self, content: str | bytes, extension: str, extra: str, source: str) -> None:
        """torch keyed `content` to `source`: remember the artifact's identity, place it."""
        artifact = artifact_of(extension, source)
        if artifact is None:
            return
        ident = identity(content, extension, extra)
        artifact = os.path.realpath(artifact)
        with self._lock:
            self.records[artifact] = ident
            shipped = self.available.get(ident)
        if shipped is not None and shipped != artifact and not os.path.exists(artifact) \
                and os.path.exists(shipped):
            _link_or_copy(shipped, artifact)
            self.placed += 1

    def learn(self, root: Path, ids: Mapping[str, str]) -> None:
        """A pack's files are unpacked under `root`: they may stand in for their identities."""
        inside = os.path.join(os.path.realpath(root), "")
        with self._lock:
            for name, ident in ids.items():
                path = os.path.realpath(root / name)
                if not path.startswith(inside):  # only files of the pack stand in for kernels
                    continue
                self.records[path] = ident
                self.available.setdefault(ident, path)

    def ids_for(self, files: Mapping[str, Path]) -> dict[str, str]:
        """Identities of those of `files` (name -> path) this process knows."""
        with self._lock:
            return {name: self.records[key] for name, path in files.items()
                    if (key := os.path.realpath(path)) in self.records}


def content_ids(names: Iterable[str], ids: Mapping[str, str]) -> set[str]:
    """What a set of compiled files holds, path-free: identities, else names.

    Only compiled output counts (a `.h` stub is rewritten by torch wherever it runs).
    """
    return {ids.get(n, "name:" + n) for n in names if n.endswith(ARTIFACT_SUFFIXES)}


def dedupe(files: Mapping[str, Path], ids: Mapping[str, str]) -> dict[str, Path]:
    """`files` keeping one file per identity: a file placed here under a local name is the
    same kernel as the shipped original next to it, and need not travel twice."""
    kept: dict[str, Path] = {}
    seen: set[str] = set()
    for name in sorted(files):
        ident = ids.get(name)
        if ident is not None:
            if ident in seen:
                continue
            seen.add(ident)
        kept[name] = files[name]
    return kept


def _link_or_copy(src: str, dest: str) -> None:
    """Put `src` at `dest` atomically (a hard link when they share a file system)."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = os.path.join(os.path.dirname(dest), f".{os.path.basename(dest)}.{uuid.uuid4().hex}")
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copy2(src, tmp)
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


_recorder = KeyRecorder()


def recorder() -> KeyRecorder:
    """The process's one recorder (torch's key function is process-wide too)."""
    return _recorder
