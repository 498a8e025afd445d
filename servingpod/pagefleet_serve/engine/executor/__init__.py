"""How the engine core reaches the model's ranks: an `Executor` makes every call that runs
the model or sizes its KV cache on every rank with the same inputs. `UniprocExecutor`: one
rank, the core's own runner; `MultiprocExecutor`: worker processes over
`torch.distributed` (`worker`), rank 0 staying in the core process with the scheduler. The
model runner knows nothing of ranks."""
