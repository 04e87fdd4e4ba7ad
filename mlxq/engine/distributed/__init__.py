"""One worker over several machines through ``mx.distributed``: the MLX side.

- :mod:`~mlxq.engine.distributed.start`: joining the group (with a deadline) and the
  start-up check that every rank runs the same mlxq and the same model;
- :mod:`~mlxq.engine.distributed.split`: by heads or by layers, which and why, and loading
  this rank's part;
- :mod:`~mlxq.engine.distributed.tensor`: the model split by heads (mlx-lm's ``shard()``,
  tensor parallel);
- :mod:`~mlxq.engine.distributed.stages`: the model split by layers, a stage a rank
  (pipeline parallel);
- :mod:`~mlxq.engine.distributed.channel`: rank 0's bytes to every rank over the group's
  ``all_sum`` (MLX moves arrays only), with byte counts;
- :mod:`~mlxq.engine.distributed.relay`: rank 0's messages and sampled tokens to every
  rank point to point (a pipeline's ranks must not be lined up by a collective);
- :mod:`~mlxq.engine.distributed.lockstep`: tensor parallel's engine: rank 0 replicates
  every call that changes engine state to the other ranks' identical engines;
- :mod:`~mlxq.engine.distributed.pipeline`: pipeline parallel's engines, one per
  micro-batch on every rank, taking turns;
- :mod:`~mlxq.engine.distributed.silence`: the watchdog of a wait with no deadline of its
  own (MLX's init, a rank waiting for rank 0).
"""
