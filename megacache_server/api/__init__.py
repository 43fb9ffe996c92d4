"""The HTTP layer: routes translate headers and status codes to calls on the cache service
(`megacache_server.service`) and back, and nothing else; middleware and the uvicorn
connection guard bound what a request may cost before any route runs."""
