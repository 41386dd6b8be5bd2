"""Tensor parallelism on ``mx.distributed``: rank 0's executor, the other ranks' worker loop,
the wire format between them, and sharding checks."""
