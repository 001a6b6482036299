"""What the coordinator side (strategies/) and the node programs (nodes/) share, below
both: the Separation protocol (`protocol`: events, commands, replies and data messages)
and the trainer's step every strategy's trainer takes the same way (`training`: build the
`Learner`, checkpoint, save the final policy, shape a metrics record)."""
