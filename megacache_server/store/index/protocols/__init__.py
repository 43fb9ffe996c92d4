"""The storage protocols of the index, one module per role, each declared and documented
there and nowhere else: a backend's module of the same name (`sqlite/entries.py`,
`redis/entries.py`, ...) says how it stores, not what. `base.Index` is all of them at once."""
