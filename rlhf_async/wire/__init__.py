"""Wire layer: the message protocol, ZeroMQ transport, CURVE security, buffer policy.
No torch.distributed, no RL."""
