"""What one caller may use: rates per token (`ratelimit`), the bytes and records it may hold
(`quotas`) and the budget every view spends (`views`). Each limit is kept in the index, so
it holds across workers and replicas."""
