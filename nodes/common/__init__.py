"""What every node program shares: its context from the spec (`context`) and the busy/idle
clock of its stage (`stage`)."""
