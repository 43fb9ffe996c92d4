"""The cache service: every rule of the cache (namespaces, quotas, budget and eviction,
blob ownership, referential checks, event limits, tokens, signing), bound to the caller.
The HTTP routes, the CLI, the background GC, fsck and the dashboard all call it; it knows
nothing of HTTP and reaches storage only through `megacache_server.store`."""
