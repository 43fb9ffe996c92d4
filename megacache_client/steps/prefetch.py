"""Prefetch while the trainer initialises: download what the first compile will need.

Started in a background thread as soon as the client is enabled (right after `import torch`
in zero-code mode), long before the first `torch.compile`, so downloads overlap the
trainer's own set-up (data loading, model construction, process groups). It fetches what
does not depend on the compiled module:

- the toolchain pack (precompiled headers), keyed by torch + compiler + ISA: any entry of
  this env and hw carries it;
- with a model name given (MEGACACHE_MODEL, and MEGACACHE_CODE when known), the newest
  entry of that model, env and hw, and every blob it names: usually the one the first
  compile asks for, which then needs no request at all.

Blobs land in the node cache (once per node, verified) and the kernel and toolchain packs
are unpacked where torch looks for them (their files are content-keyed by torch, so placing
them early is harmless even if the first compile then wants another entry); the session
takes all of it from there without downloading, re-hashing or unpacking again. The first
compile waits only for a prefetch still running, at most `prefetch_wait_s`; whatever fails
here is only logged at debug level and the session fetches on its own, as it would
without prefetch.

The toolchain pack (~150 MB of headers once unpacked) comes last, after the first compile
may go on: torch loads the bundle and the graphs while the headers are unpacked, and waits
for them (bounded) where it names its precompiled header (`KeyRecorder.hold_headers`).
Every load needs them, an exact hit too: Inductor precompiles its header before loading
any C++ kernel, a cached one included.

The thread imports nothing of torch's compiler: importing Dynamo there while the trainer's
thread imports it too broke a real job; what it needs is imported on the enabling thread.
"""

from __future__ import annotations

import logging
import threading
import time

from megacache_client.config import ClientConfig
from megacache_client.errors import UntrustedEntryError, UntrustedWriterError, exc_text
from megacache_client.steps.fetch import fetch_blob, skip_reason
from megacache_client.steps.load import place, read_bundle
from megacache_client.steps.prefetched import PrefetchResult
from megacache_client.torch import env as torch_env
from megacache_client.torch import relocate
from megacache_client.torch.packs import pack_kind
from megacache_client.transport.client import Deadline, RemoteCache
from megacache_client.transport.nodecache import NodeCache
from megacache_client.transport.trust import ServedEntry
from megacache_client.wire.manifest import BlobRef, Manifest, Scalar

log = logging.getLogger("megacache")

Wanted = tuple[ServedEntry, BlobRef]
"""A blob to fetch, with the admitted entry that names it (what the gate admits it by)."""
TOOLCHAIN_NOMINEES = 3
"""Entries of the listing whose toolchain pack is tried, each read by key."""


class Prefetcher:
    """One background prefetch for one process; `wait()` is the only way to read it."""

    def __init__(self, config: ClientConfig, node: NodeCache,
                 previous: Prefetcher | None = None) -> None:
        self.config = config
        self.node = node
        self.previous = previous
        """An earlier prefetch of this process (the zero-code hook's, before an explicit
        enable() named the model): this one continues it instead of fetching twice."""
        self.deadline: Deadline = (previous.deadline if previous is not None
                                   and previous.troubled() else Deadline(config.load_deadline_s))
        """The load step's budget. A prefetch that continues one still running or failed
        shares its budget, so a hung server costs the process one deadline, not one per
        prefetch; after one that went well (the trainer may have spent minutes setting up
        since), it gets its own."""
        self.result = PrefetchResult()
        self._fetched = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megacache-prefetch",
                                        daemon=True)

    def start(self) -> Prefetcher:
        # The env and hw components and the dirs read torch (versions, ISA, its cache-dir
        # code): done here, on the caller's thread, never beside the trainer's own imports.
        # None of it imports Dynamo or Inductor (`torch_env.cpp_compiler`): that would
        # add ~2 s to every start before the trainer's own set-up even begins.
        try:
            self._components = (torch_env.env_component(), torch_env.hw_component())
            # what the thread's checks and unpacking look up, imported here once
            torch_env.inductor_cache_dir(), torch_env.header_dir()
            relocate.build_facts()
        except Exception as exc:  # the session fetches on its own
            self.result.error = exc_text(exc)
            self._fetched.set()
            self._done.set()
            return self
        self._thread.start()
        return self

    def troubled(self) -> bool:
        """Still fetching, or it failed: what an earlier prefetch shares its deadline for."""
        return not self._fetched.is_set() or bool(self.result.error)

    def wait(self, timeout: float) -> PrefetchResult | None:
        """The result once the downloads have finished, or None if they are still running."""
        return self.result if self._fetched.wait(timeout) else None

    def wait_toolchain(self, timeout: float) -> bool:
        """Wait for the toolchain pack to be in place (after `wait`); False on timeout."""
        return self._done.wait(timeout)

    def _run(self) -> None:
        started = time.monotonic()
        toolchain: Wanted | None = None
        try:
            toolchain = self._prefetch()
        except Exception as exc:  # the session fetches on its own
            self.result.error = exc_text(exc)
            log.debug("megacache: prefetch failed: %s", self.result.error)
        finally:
            self.result.seconds = time.monotonic() - started
            self._fetched.set()
        # No import warm-up here: importing torch._dynamo on this thread while the trainer's
        # thread imports it too broke a real job (a partially initialised module, seen with
        # transformers); the first compile imports what it needs itself.
        try:
            if toolchain is not None:
                self.result.toolchain_bytes = self._take_toolchain(toolchain)
        except Exception as exc:  # g++, if it ever runs, builds its own headers
            self.result.toolchain_error = exc_text(exc)
            log.debug("megacache: prefetch of the toolchain failed: %s",
                      self.result.toolchain_error)
        finally:
            self._done.set()

    def _continue_previous(self) -> None:
        """Take over what an earlier prefetch of this process fetched (waiting for it,
        bounded). Not its toolchain pack: that one may still be on its way, and the model's
        entry must not queue behind ~20 MB of headers (`_take_toolchain` waits for it)."""
        if self.previous is None:
            return
        done = self.previous.wait(self.deadline.cap(self.config.load_deadline_s))
        if done is not None:
            self.result.paths.update((d, p) for d, p in dict(done.paths).items()
                                     if d != done.toolchain)
            self.result.placed.update((d, n) for d, n in dict(done.placed).items()
                                      if d != done.toolchain)
            self.result.bytes_down += done.bytes_down

    def _take_toolchain(self, toolchain: Wanted) -> int:
        """Fetch and place the toolchain pack, or take it from the earlier prefetch that is
        already fetching it; returns the bytes downloaded."""
        previous, digest = self.previous, toolchain[1].digest
        if previous is not None and previous.result.toolchain == digest and \
                previous.wait_toolchain(self.deadline.cap(self.config.load_deadline_s)):
            done = previous.result
            if digest in done.placed:
                self.result.paths[digest] = done.paths[digest]
                self.result.placed[digest] = done.placed[digest]
                return done.toolchain_bytes
        return self._fetch_and_place([toolchain])  # none on the way, or it failed

    def _prefetch(self) -> Wanted | None:
        """Fetch and place all but the toolchain pack; returns that, for afterwards."""
        self._continue_previous()
        env, hw = self._components
        # the load step's deadline bounds the prefetch too: a hung server costs it no more
        # than it costs the load, and the node's breaker then spares the load the wait
        with RemoteCache(self.config, deadline=self.deadline) as remote:
            wanted: list[Wanted] = []
            if self.config.model:
                found = self._model_entry(remote, env, hw)
                if found is not None:
                    self.result.entry, self.result.entry_key = found, found.key
                    wanted += [(found, b) for b in found.manifest.blobs
                               if not skip_reason(self.config, b)]
            if self.config.ship_toolchain and not any(b.role == "toolchain"
                                                      for _, b in wanted):
                toolchain = self._toolchain(remote, env, hw)
                if toolchain is not None:
                    wanted.append(toolchain)
            wanted = [w for w in wanted if w[1].digest not in self.result.paths]
            last = next((w for w in wanted if w[1].role == "toolchain"), None)
            self.result.bytes_down += self._fetch_and_place(
                [w for w in wanted if w is not last], remote)
            if last is not None:
                self.result.toolchain = last[1].digest
            return last

    def _fetch_and_place(self, wanted: list[Wanted], remote: RemoteCache | None = None) -> int:
        """Download the blobs into the node cache, then, each admitted by the gate, unpack
        the packs where torch looks and read the bundle; returns the bytes downloaded."""
        if remote is None:
            with RemoteCache(self.config, deadline=self.deadline) as own:
                return self._fetch_and_place(wanted, own)
        downloaded = 0
        for _, blob in wanted:
            path, n = fetch_blob(remote, self.node, blob)
            self.result.paths[blob.digest] = path
            downloaded += n
        cap = self.config.max_raw_bytes
        for entry, blob in wanted:
            admitted = remote.gate.admit(entry, blob.role, self.result.paths[blob.digest])
            if pack_kind(blob.role) is not None:
                self.result.placed[blob.digest] = place(admitted, cap)
            elif blob.role == "megacache":
                self.result.bundles[blob.digest] = read_bundle(admitted, cap)
        return downloaded

    def _model_entry(self, remote: RemoteCache, env: dict[str, Scalar],
                     hw: dict[str, Scalar]) -> ServedEntry | None:
        """The model's newest entry here, read by key through the gate; None when there is
        none or the gate refuses it (the load then decides alone; the toolchain pack is
        still fetched)."""
        newest = self._newest_of_model(remote, env, hw)
        if newest is None:
            return None
        try:
            return remote.get_entry(newest.key)
        except (UntrustedEntryError, UntrustedWriterError) as exc:
            log.debug("megacache: prefetch: entry %s refused: %s", newest.key[:12], exc)
            return None

    def _newest_of_model(self, remote: RemoteCache, env: dict[str, Scalar],
                         hw: dict[str, Scalar]) -> Manifest | None:
        """The newest entry of the configured model here; one of its code version if given."""
        entries = [m for m in remote.list_entries(model=self.config.model, env=env, hw=hw,
                                                  limit=50)
                   if m.fingerprint.namespace == self.config.namespace]
        same_code = [m for m in entries if m.fingerprint.code == self.config.code]
        chosen = same_code or entries
        return chosen[0] if chosen else None

    def _toolchain(self, remote: RemoteCache, env: dict[str, Scalar],
                   hw: dict[str, Scalar]) -> Wanted | None:
        """A toolchain pack any model of this env and hw published (they are model-free).

        The listing only nominates (it is not signed, and names any writer of the
        namespace): the pack is taken from the nominee's entry read by key through the gate,
        and only when that entry is of this namespace, env and hw."""
        nominees = [m for m in remote.list_entries(env=env, hw=hw, limit=20)
                    if (b := m.blob("toolchain")) is not None
                    and not skip_reason(self.config, b)]
        for nominee in nominees[:TOOLCHAIN_NOMINEES]:
            try:
                served = remote.get_entry(nominee.key)
            except (UntrustedEntryError, UntrustedWriterError) as exc:
                log.debug("megacache: toolchain of %s refused: %s", nominee.key[:12], exc)
                continue
            fp = served.manifest.fingerprint if served is not None else None
            blob = served.manifest.blob("toolchain") if served is not None else None
            if served is not None and fp is not None and blob is not None \
                    and (fp.namespace, fp.env, fp.hw) == (self.config.namespace, env, hw) \
                    and not skip_reason(self.config, blob):
                return served, blob
        return None

