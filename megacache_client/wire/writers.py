"""Whose entries a consumer runs: the trusted-writers policy, one definition for both sides.

A consumer sets `MEGACACHE_TRUSTED_WRITERS` (comma-separated token names, name prefixes
ending in `*`, or `scope:<scope>` for a scope only those writers' tokens hold). The client
refuses an entry whose provenance (`x-megacache-provenance`) names no trusted writer; the
server applies the same policy when it chooses a fallback for that consumer (`writers` on
`GET /v1/ac` and in a resolve's `fallback` rule), so a consumer that trusts only some
writers is offered the newest entry it would run, not the newest it would refuse.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

SCOPE = re.compile(r"scope:[a-z]{1,32}")
NAME = re.compile(r"[A-Za-z0-9._@:+-]{1,128}\*?")  # a token name's alphabet (+ a prefix's *)
MAX_POLICY_CHARS = 4096
"""The longest policy text the server reads (a request parameter)."""


@dataclass(frozen=True)
class WriterPolicy:
    names: frozenset[str]
    prefixes: tuple[str, ...]
    scopes: frozenset[str]

    @classmethod
    def parse(cls, text: str) -> WriterPolicy | None:
        """The policy in `text` (comma-separated), None when empty (any writer); a
        ValueError names an item that is none of the three forms."""
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            return None
        bad = [item for item in items if not SCOPE.fullmatch(item)
               and (item.startswith("scope:") or not NAME.fullmatch(item))]
        if bad:
            raise ValueError(f"{bad[0][:80]!r} is not a token name, a name prefix ending in * "
                             "or scope:<scope>")
        return cls(names=frozenset(i for i in items if not i.startswith("scope:")
                                   and not i.endswith("*")),
                   prefixes=tuple(i[:-1] for i in items if i.endswith("*")),
                   scopes=frozenset(i.removeprefix("scope:") for i in items
                                    if i.startswith("scope:")))

    def trusts(self, writer: str, scopes: list[str] | tuple[str, ...]) -> bool:
        return writer in self.names or writer.startswith(self.prefixes) \
            or bool(self.scopes.intersection(scopes))

    def refusal(self, provenance: str | None) -> str:
        """Why an entry served with this provenance is not run ("" when it is trusted)."""
        written = _written_by(provenance)
        if written is None:
            return "the server did not say who wrote it"
        writer, scopes = written
        if self.trusts(writer, scopes):
            return ""
        return f"written by {writer[:128]!r} (scopes {','.join(scopes)[:64]}), not a trusted writer"


def _written_by(provenance: str | None) -> tuple[str, list[str]] | None:
    if not provenance:
        return None
    try:
        data: Any = json.loads(provenance)
        writer, scopes = data["writer"], data["writer_scopes"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(writer, str) or not isinstance(scopes, list) \
            or not all(isinstance(s, str) for s in scopes):
        return None
    return writer, scopes
