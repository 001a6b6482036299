"""The Separation pipeline, coordinator side: generator, scorer and trainer nodes (the
programs in the top-level `nodes/` package) joined by ZeroMQ queues.

What the two sides say to each other (control events, commands and replies; prompt chunks
and rollout batches as data messages) is `rlhf_async/pipeline/protocol.py`, below both.
Here `clients` are the coordinator's typed clients of the nodes (and the weight-sync group
they build), `startup` waits for the nodes to load, `trainer_ranks` keeps a multi-rank
trainer one group, `driver` dispatches under the staleness gate and keeps the weight
versions and metrics, `runner` builds the node specs and runs them on this machine,
`on_ray` on a Ray cluster (`tcp` re-addresses the specs for it), `strategy` is the preset
and checks behind `placement.strategy = separation`.

The package imports none of them itself: importing one must not import the runners (and
with them Ray, when installed).
"""
