"""Storage: a blob store and an index behind small protocols, built from settings. It
implements what the cache service asks and decides no rule of its own."""
