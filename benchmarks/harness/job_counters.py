"""torch's own cache counters, as the test jobs print them: read from torch, not through
the client under test, so a client that miscounts cannot vouch for itself."""

from __future__ import annotations

from torch._dynamo.utils import counters


def cache_counters() -> dict[str, int]:
    return {
        "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
        "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_miss": counters["aot_autograd"]["autograd_cache_miss"],
        "precompile_hit": counters["dynamo_cache"]["dynamo_cache_hit"],
    }
