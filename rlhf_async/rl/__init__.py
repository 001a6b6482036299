"""RL: the algorithms (advantages, KL, losses), scoring, the Learner, staleness, checkpoints."""
