"""How a response is judged beside a reward model: the user's rule function (`reward_fn`),
a reward server over HTTP (`remote_reward`), a distillation teacher (`teacher`)."""
