"""Everything that touches torch's internals: the torch.compile hook, Mega-Cache save and
load, precompiled Dynamo, kernel and toolchain packs, the vec-ISA probe, kernel relocation,
and the torch environment the fingerprint reads; the job's telemetry (optimizer steps,
heartbeats, torch.distributed.checkpoint timed). A torch upgrade touches this folder only.

The modules import torch lazily (inside functions): the base client never requires it.
"""
