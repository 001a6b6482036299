"""Models and the data they make: HF actor/critic/reward/reference, the keyed sampler, rollout batches, keyed randomness."""
