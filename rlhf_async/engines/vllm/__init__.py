"""The vLLM generation engine (`engine.VLLMEngine`, the `vllm` line of `ENGINES`; the
`[vllm]` extra) and its glue inside vLLM's workers: our bucketed broadcast as vLLM's
weight-transfer backend (`transfer`), registered by the worker extension (`worker`).
Nothing here imports vllm at package import."""
