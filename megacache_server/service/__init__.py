"""The cache service: every rule of the cache, bound to the caller. The HTTP routes, the
CLI, the background GC, fsck and the dashboard all call it; it knows nothing of HTTP and
reaches storage only through `megacache_server.store`. `cache` and `tenant` say how it is
put together."""
