"""The scorer node: reward and reference scores of each rollout chunk (`main`)."""
