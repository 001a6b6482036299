"""Control plane: the coordinator (launch, handshake, heartbeats, restarts), its client, chaos."""
