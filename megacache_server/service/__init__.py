"""The cache service: every rule of the cache, bound to the caller. The HTTP routes, the
CLI, the background GC, fsck and the dashboard all call it; it knows nothing of HTTP and
reaches storage only through `megacache_server.store`.

Grouped by concern, one subpackage each: `caching` (the cache itself: `cache` and `tenant`
say how it is put together, from blobs, entries and resolutions), `housekeeping` (eviction,
the collector running it, fsck), `security` (who may do what, signing, trust in what is
stored, provenance, quarantine), `limits` (what one caller may use: rates, quotas, view
budgets), `observability` (metrics, the counting decorators, the read side of events and
its reports) and `ett` (Effective Training Time)."""
