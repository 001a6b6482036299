"""The Separation pipeline: generator, scorer and trainer nodes joined by ZeroMQ queues.

`wire` turns prompt chunks and rollout batches into protocol messages, `stage` measures
each node's busy and idle time, `events` the typed control messages, `clients` the
coordinator's typed clients of the nodes (and the weight-sync group they build), `startup`
waits for the nodes to load, `trainer_ranks` keeps a multi-rank trainer one group, `driver`
is the coordinator's side (dispatch under the staleness gate, weight-version bookkeeping,
metrics), `runner` builds the node specs and runs them, `strategy` is the preset and checks
behind `placement.strategy = separation`.

The package imports none of them itself: a node process needs `wire`, `events` and
`stage`, not the runners (and with them Ray, when installed).
"""
