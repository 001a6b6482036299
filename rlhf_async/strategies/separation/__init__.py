"""The Separation pipeline, coordinator side: generator, scorer and trainer nodes (the
programs in the top-level `nodes/` package) joined by ZeroMQ queues.

`protocol` is what the two sides say to each other (control events, commands and replies;
prompt chunks and rollout batches as data messages), `clients` the coordinator's typed
clients of the nodes (and the weight-sync group they build), `startup` waits for the nodes
to load, `trainer_ranks` keeps a multi-rank trainer one group, `driver` dispatches under
the staleness gate and keeps the weight versions and metrics, `runner` builds the node
specs and runs them on this machine, `on_ray` on a Ray cluster (`tcp` re-addresses the
specs for it), `strategy` is the preset and checks behind `placement.strategy =
separation`.

The package imports none of them itself: a node process needs `protocol`, not the runners
(and with them Ray, when installed).
"""
