"""Where a blob download may be redirected: only where the server vouches.

A server with `s3_redirect` answers a blob read with a 307 to a presigned object-store URL,
so the client must follow some redirects. But a proxy between trainer and server (or a
server that is not ours) can answer the same read with a redirect anywhere: to a
cloud metadata service (169.254.169.254), to another port on the trainer's own host, to
an address of the private network only the trainer can reach. So a redirect is followed
only to

- the server's own origin (`MEGACACHE_URL`'s scheme, host and port);
- an origin listed in `MEGACACHE_REDIRECT_ORIGINS` (the operator's word: any address);
- the origin the server announced on the redirect itself (`x-megacache-blob-origin`, made
  by the server from the presigned URL). With `MEGACACHE_VERIFY_KEY` set the announcement
  counts only when the server signed it (`x-megacache-blob-origin-signature`), and then it
  may be a loopback or private address (a SeaweedFS or MinIO beside the server); without a
  key anybody on the way could have written it, so it counts only for public addresses.
  A link-local address (the metadata service's) is never announced, only configured.

The address is judged as resolved: a host name that resolves to private space is private.
The judgement comes before any connection is made to the target; a refused redirect is a
`RedirectRefused` (the load's one warning, then a cold compile) and carries our words only.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterable, Iterator, Mapping

import httpx

from megacache_client.errors import TransportError
from megacache_client.wire import headers as wire_headers
from megacache_client.wire.escape import escape
from megacache_client.wire.signing import blob_origin, message_signature_valid, origin_message

MAX_REDIRECTS = 3
"""Redirects one blob download may follow (a presigned store answers at once): nothing
else the client asks is ever redirected."""

METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata", "instance-data"})
"""Names cloud metadata services answer to, besides their link-local addresses."""
SHARED_SPACE = ipaddress.ip_network("100.64.0.0/10")
"""Carrier-grade NAT space (RFC 6598): private in effect, and home of some metadata
services (100.100.100.200); `is_private` does not cover it."""


class RedirectRefused(TransportError):
    """A blob redirect to an origin the server did not vouch for: never connected to."""


def address_class(address: str) -> str:
    """`link-local`, `loopback`, `private` or `public`: what an IP address reaches."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_link_local:
        return "link-local"
    if ip.is_loopback:
        return "loopback"
    if ip.is_private or ip.is_reserved or ip.is_unspecified or ip.is_multicast \
            or (isinstance(ip, ipaddress.IPv4Address) and ip in SHARED_SPACE):
        return "private"
    return "public"


def resolved_classes(host: str, port: int) -> set[str]:
    """The classes of every address `host` resolves to (an IP literal is itself); a name
    that does not resolve, or a metadata service's name, counts as link-local."""
    bare = host.strip("[]")
    if bare in METADATA_HOSTS:
        return {"link-local"}
    try:
        return {address_class(bare)}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return {"link-local"}
    return {address_class(str(info[4][0])) for info in infos} or {"link-local"}


class RedirectPolicy:
    """Judges each blob redirect before it is followed (`judge`)."""

    def __init__(self, server_url: str, configured: Iterable[str] = (),
                 verify_key: str | None = None) -> None:
        self.own = blob_origin(server_url)
        self.configured = frozenset(configured)
        self.verify_key = verify_key

    def judge(self, target_url: str, answer_headers: Mapping[str, str]) -> str:
        """"" when a redirect to `target_url`, answered with `answer_headers`, may be
        followed; else why not (our words, the target's host at most)."""
        origin = blob_origin(target_url)
        if origin and (origin == self.own or origin in self.configured):
            return ""
        if not origin:
            return "to a URL that is not http(s)"
        host = escape(origin.split("://", 1)[1].rsplit(":", 1)[0], 100)
        announced = answer_headers.get(wire_headers.BLOB_ORIGIN, "")
        if blob_origin(announced) != origin:
            return f"to {host}, an origin the server did not announce"
        signed = self.verify_key is not None and message_signature_valid(
            self.verify_key, origin_message(origin),
            answer_headers.get(wire_headers.BLOB_ORIGIN_SIGNATURE))
        if self.verify_key is not None and not signed:
            return f"to {host}, announced without the server's signature"
        port = int(origin.rsplit(":", 1)[1])
        classes = resolved_classes(origin.split("://", 1)[1].rsplit(":", 1)[0], port)
        if "link-local" in classes:
            return f"to {host}, a link-local or metadata address"
        if not signed and classes - {"public"}:
            return (f"to {host}, a {'/'.join(sorted(classes - {'public'}))} address "
                    "announced without a signature")
        return ""


@contextlib.contextmanager
def follow(http: httpx.Client, path: str, headers: dict[str, str], timeout: httpx.Timeout,
           policy: RedirectPolicy, what: str) -> Iterator[httpx.Response]:
    """The answer to a GET of `path` (on `http`'s server), after the redirects `policy`
    allows, each judged before anything connects to its target; a redirect elsewhere
    raises `RedirectRefused`. The bearer token goes to the server's own origin only."""
    url = http.base_url.join(path)
    for _ in range(MAX_REDIRECTS + 1):
        request = http.build_request("GET", url, headers=headers, timeout=timeout)
        if blob_origin(str(url)) != policy.own:
            request.headers.pop("authorization", None)
        r = http.send(request, stream=True, follow_redirects=False)
        location = r.headers.get("location") if r.is_redirect else None
        if location is None:
            try:
                yield r
            finally:
                r.close()
            return
        r.close()
        try:
            url = url.join(location)
        except httpx.InvalidURL:
            raise RedirectRefused(f"{what}: refused a redirect to an invalid URL",
                                  r.status_code) from None
        refusal = policy.judge(str(url), r.headers)
        if refusal:
            raise RedirectRefused(f"{what}: refused a redirect {refusal} "
                                  "(MEGACACHE_REDIRECT_ORIGINS allows one)", r.status_code)
    raise TransportError(f"{what}: more than {MAX_REDIRECTS} redirects", r.status_code)
