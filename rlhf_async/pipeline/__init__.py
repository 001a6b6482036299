"""The Separation pipeline: generator, scorer and trainer nodes joined by ZeroMQ queues.

`wire` turns prompt chunks and rollout batches into protocol messages, `stage` measures
each node's busy and idle time, `driver` is the coordinator's side (dispatch under the
staleness gate, weight-version bookkeeping, metrics), `job` builds the node specs.
"""
