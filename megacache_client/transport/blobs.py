"""The blob routes of `RemoteCache`: ask for, upload and download content-addressed bytes.

A blob is big (a bundle, a pack of kernels) and is moved as a stream, never held whole:
an upload is read from its file once per try, a download is written to its file and hashed
as it arrives, and both earn their clock a second per MiB moved, so a big blob at a useful
rate is never cut off and a stalled one is. A download is a request like any other (a 5xx
is retried), a broken stream resumes with a Range request, and it is the one request that
may be redirected (to a presigned store, without the token: `redirects.py`). What the
bytes must be (the manifest's size and digest) is checked here, before anyone reads them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from megacache_client.errors import CorruptBlobError, Finding, TransportError
from megacache_client.transport import reader, redirects
from megacache_client.transport.exchange import Exchange
from megacache_client.transport.retry import Deadline, RetryableStatus, retry_after_s, retryable
from megacache_client.wire import routes
from megacache_client.wire.escape import escape
from megacache_client.wire.signing import blob_origin

ByteProgress = Callable[[int, int], None]
"""Told (bytes moved so far, bytes in all) as a blob streams: a progress bar's callback."""
CHUNK = 1024 * 1024


class BlobRoutes(Exchange):
    """The content-addressed store (CAS), by sha256 digest."""

    def has_blob(self, digest: str) -> bool:
        a = self._exchange(routes.HEAD_BLOB, "head blob", digest=digest)
        if a.status == 404:
            return False
        self._expect(a, (200,), "head blob")
        return True

    def upload_blob(self, path: Path, digest: str,
                    progress: ByteProgress | None = None) -> bool:
        """PUT a file's bytes under `digest`, streamed. True when the server did not have it.

        The upload's clock starts at the read timeout and earns a second per MiB sent, so
        a big blob at a useful rate is never cut off and a stalled one is."""
        size = path.stat().st_size
        clock = Deadline(self.config.read_timeout_s)
        a = self._exchange(routes.PUT_BLOB, "upload blob", clock=clock, digest=digest,
                           content=lambda: _file_chunks(path, progress, clock),
                           headers={"content-length": str(size),
                                    "content-type": "application/octet-stream"})
        self._expect(a, (200, 201), "upload blob")
        return a.status == 201

    def download_blob(self, digest: str, size: int, dest: Path,
                      progress: ByteProgress | None = None) -> str:
        """Stream a blob into `dest`, resuming with Range after a broken connection; returns
        its sha256, computed while it was written.

        The file is checked against `digest` and `size` before this returns; on mismatch it
        is deleted and CorruptBlobError raised.
        """
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            return self._download_to(digest, size, dest, progress)
        except BaseException:
            dest.unlink(missing_ok=True)
            raise

    def _download_to(self, digest: str, size: int, dest: Path,
                     progress: ByteProgress | None) -> str:
        hashing = _Hashing()
        with open(dest, "wb") as f:
            self._retrying(lambda: self._stream_into(f, hashing, digest, size, progress),
                           f"download {digest[:12]}")
        actual_size = dest.stat().st_size
        actual = hashing.sha.hexdigest()
        if actual_size != size or actual != digest:
            # our words only: what the manifest promised, never the size or hash of what was
            # served (that is a foreign answer's, and the report and event go back out)
            wrong = (f"are not the manifest's {size} bytes" if actual_size != size
                     else "do not hash to its digest")
            message = f"blob {digest[:12]}… is corrupt: the bytes served {wrong}"
            raise CorruptBlobError(message, finding=Finding(
                "size" if actual_size != size else "digest", digest, detail=message))
        return actual

    def _stream_into(self, f: Any, hashing: _Hashing, digest: str, size: int,
                     progress: ByteProgress | None) -> None:
        """One try: GET the blob (the rest of it, after a broken try) and append it to `f`
        (and to its hash), within its clock: the read timeout, earning a second per MiB."""
        done = f.tell()
        headers = {"range": f"bytes={done}-"} if done else {}
        what = f"download {digest[:12]}"
        clock = Deadline(self.config.read_timeout_s)
        with reader.operation(self.deadline, clock), redirects.follow(
                self._http, routes.GET_BLOB.url(digest=digest), headers, self._timeout(),
                self.redirects, what) as r:
            reader.refuse_encoded(r)
            if r.status_code == 200 and done:  # the server sent it whole: start over
                f.seek(0)
                f.truncate()
                hashing.sha = hashlib.sha256()
                done = 0
            elif r.status_code not in (200, 206):
                raise self._blob_error(r, what)
            declared = reader.declared_length(r)
            if declared is not None and done + declared > size:
                message = (f"blob {digest[:12]}… is declared longer than the manifest's "
                           f"{size} bytes")
                raise CorruptBlobError(message, finding=Finding("size", digest,
                                                                detail=message))
            for chunk in r.iter_raw(CHUNK):
                f.write(chunk)
                hashing.sha.update(chunk)
                done += len(chunk)
                self.deadline.credit(len(chunk))
                clock.credit(len(chunk))
                if done > size:
                    message = f"blob {digest[:12]}… is longer than {size} bytes"
                    raise CorruptBlobError(message, finding=Finding("size", digest,
                                                                    detail=message))
                if progress:
                    progress(done, size)
        f.flush()

    def _blob_error(self, r: httpx.Response, what: str) -> TransportError:
        """A blob answer that is not the blob: retryable or not, in our words. The server's
        own error message is kept (escaped); an answer from elsewhere (the presigned store)
        gives its status and host only, never its body."""
        if blob_origin(str(r.url)) == self.redirects.own:
            said = reader.error_message(reader.read_capped(r, reader.SMALL_JSON, what))
        else:  # the store's body is not even read
            said = f"from {escape(r.url.host, 100)}"
        if retryable(r.status_code):
            return RetryableStatus(f"{what}: HTTP {r.status_code} {said}", r.status_code,
                                   retry_after_s(r.headers.get("retry-after")))
        return TransportError(f"{what}: HTTP {r.status_code} {said}", r.status_code)


def _file_chunks(path: Path, progress: ByteProgress | None,
                 clock: Deadline) -> Iterator[bytes]:
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            done += len(chunk)
            clock.credit(len(chunk))
            if progress:
                progress(done, total)
            yield chunk


class _Hashing:
    """The sha256 of a download so far (a try that starts over starts it over)."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()
