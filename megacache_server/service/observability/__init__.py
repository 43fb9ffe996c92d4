"""What the cache shows of itself: the Prometheus families (`metrics`) within their series
budget (`metric_budget`), the counting decorators (`metered`), and the read side of client
events (`events`) with the reports made of them (`reports`)."""
