"""Control plane: the coordinator (control socket, handshake, commands, stop), its supervisor
(launch, liveness, restarts), its client, chaos."""
