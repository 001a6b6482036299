"""Our own generation engine (`engine.TorchEngine`, the `torch` line of `ENGINES`) and its
parts: continuous batching over one KV cache (`continuous`) and the KV kept across a
multi-turn episode's turns (`prefix_kv`)."""
