"""TokenStore on Redis: a hash per token, holding its hash, never the token."""

from __future__ import annotations

from megacache_server.store.index.protocols.tokens import TokenRecord, TokenStore
from megacache_server.store.index.redis.connection import RedisConnection, text


class RedisTokens(RedisConnection, TokenStore):
    async def put_token(self, token: TokenRecord) -> None:
        async def op() -> None:
            await self.r.hset(self.keys.token(token.token_id), mapping={
                "name": token.name, "token_hash": token.token_hash,
                "scopes": ",".join(token.scopes), "namespace": token.namespace,
                "created_at": token.created_at, "revoked": "1" if token.revoked else "0",
                **({"expires_at": token.expires_at} if token.expires_at is not None else {})})
            await self.r.zadd(self.keys.tokens(), {token.token_id: token.created_at})

        await self._do(op)

    async def get_token(self, token_id: str) -> TokenRecord | None:
        async def op() -> TokenRecord | None:
            data = await self.r.hgetall(self.keys.token(token_id))
            if not data:
                return None
            return TokenRecord(token_id, text(data[b"name"]) or "",
                               text(data[b"token_hash"]) or "",
                               tuple((text(data[b"scopes"]) or "").split(",")),
                               text(data[b"namespace"]) or "", float(data[b"created_at"]),
                               text(data[b"revoked"]) == "1",
                               float(data[b"expires_at"]) if b"expires_at" in data else None)

        return await self._do(op)

    async def list_tokens(self) -> list[TokenRecord]:
        ids = await self._do(lambda: self.r.zrange(self.keys.tokens(), 0, -1))
        found = [await self.get_token(text(i) or "") for i in ids]
        return [t for t in found if t is not None]

    async def revoke_token(self, token_id: str) -> bool:
        async def op() -> bool:
            if not await self.r.exists(self.keys.token(token_id)):
                return False
            await self.r.hset(self.keys.token(token_id), "revoked", "1")
            return True

        return await self._do(op)
