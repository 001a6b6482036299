"""Models and the data they make: HF actor/critic/reward/reference, the keyed sampler and
the `generate` role, prompt and rollout batches, keyed randomness."""
