"""The generator node: the loop (`main`), weights staged between decode steps (`inflight`)
and the node side of continuous batching (`continuous`); the model work is its engine's
(`rlhf_async/engines/`)."""
