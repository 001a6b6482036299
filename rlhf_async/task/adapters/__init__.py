"""Adapters of outside environment and dataset packages: OpenEnv servers (`openenv`),
verifiers environments (`verifiers`), reasoning-gym datasets (`reasoning_gym`)."""
