"""Tokens: bearer tokens as stored (hashed)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenRecord:
    """A bearer token as stored: only its hash, never the token itself."""

    token_id: str
    name: str
    token_hash: str
    scopes: tuple[str, ...]
    namespace: str
    created_at: float
    revoked: bool = False
    expires_at: float | None = None  # epoch seconds; None: never

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


class TokenStore(ABC):
    """Bearer tokens, hashed."""

    @abstractmethod
    async def put_token(self, token: TokenRecord) -> None:
        """Store a new token record."""

    @abstractmethod
    async def get_token(self, token_id: str) -> TokenRecord | None:
        """A token record by id (revoked ones included)."""

    @abstractmethod
    async def list_tokens(self) -> list[TokenRecord]:
        """Every token record, oldest first."""

    @abstractmethod
    async def revoke_token(self, token_id: str) -> bool:
        """Revoke a token; False if there is no such token."""
