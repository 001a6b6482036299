"""Planning: the cost model, the `auto` choice, simulation of large clusters, calibration
on this machine."""
