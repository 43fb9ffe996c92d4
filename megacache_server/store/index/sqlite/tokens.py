"""TokenStore on SQLite: a row per token, holding its hash, never the token."""

from __future__ import annotations

from typing import Any

from megacache_server.store.index.protocols.tokens import TokenRecord, TokenStore
from megacache_server.store.index.sqlite.connection import SqliteConnection


class SqliteTokens(SqliteConnection, TokenStore):
    async def put_token(self, token: TokenRecord) -> None:
        await self._write(lambda c: c.execute(
            f"INSERT INTO tokens ({TOKEN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (token.token_id, token.name, token.token_hash, ",".join(token.scopes),
             token.namespace, token.created_at, int(token.revoked), token.expires_at)))

    async def get_token(self, token_id: str) -> TokenRecord | None:
        row = await self._read(f"SELECT {TOKEN_COLUMNS} FROM tokens WHERE token_id=?",
                               (token_id,))
        return _token(row) if row else None

    async def list_tokens(self) -> list[TokenRecord]:
        return await self._run(lambda c: [_token(r) for r in c.execute(
            f"SELECT {TOKEN_COLUMNS} FROM tokens ORDER BY created_at").fetchall()])

    async def revoke_token(self, token_id: str) -> bool:
        return await self._run(lambda c: c.execute(
            "UPDATE tokens SET revoked=1 WHERE token_id=?", (token_id,)).rowcount > 0)


TOKEN_COLUMNS = "token_id, name, token_hash, scopes, namespace, created_at, revoked, expires_at"


def _token(row: tuple[Any, ...]) -> TokenRecord:
    token_id, name, token_hash, scopes, namespace, created_at, revoked, expires_at = row
    return TokenRecord(token_id, name, token_hash, tuple(scopes.split(",")), namespace,
                       created_at, bool(revoked), expires_at)
