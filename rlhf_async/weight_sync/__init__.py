"""Weight broadcast from the trainer to the generators' shadow actors (Separation strategy).

Why: in Separation the generators hold their own copy of the actor; after every N optimizer
steps trainer rank 0 pushes the new weights to all of them through a dedicated
torch.distributed group (gloo on CPU, NCCL on GPU) built beside any DDP group. Tensors go in
fixed-size byte buckets; the small bucket plan goes over ZeroMQ (the caller ships it).

Sequence (the coordinator owns the rendezvous; ZeroMQ messages are the caller's):

    trainer rank 0                               generator with rank r (1..W-1)
    sender = make_sender("gloo", bucket_mb=100)   receiver = make_receiver("gloo")
    spec = sender.prepare(GroupSpec(...port=0))
      -> coordinator ships spec.to_dict() and r --> receiver.connect(GroupSpec.from_dict(d), r)
    sender.connect(spec)                            (started first, in a thread)
    every update:
      plan = sender.plan(weights_of(actor), v)  -> plan dict over ZeroMQ
      sender.send(weights, plan)                   w = receiver.receive(plan)
        (weights: the mapping, or consecutive groups of it, e.g. a ZeRO-3 model gathered
         ~bucket_mb at a time; the plan then comes from meta tensors, nothing gathered)
                                                   version = w.load_into(model)  # atomic
    generator restarted: coordinator bumps the epoch, everyone calls connect(spec.with_epoch(e+1))

Delta updates (`make_sender(..., delta=True)`): the sender keeps a copy of the last sent
bytes and, while the group's incarnation and layout stay the same, sends each bucket as only
the changes of its 16-bit words (`delta.py`); receivers rebuild the bytes exactly in their staging
buffer. A receiver without the base raises WeightSyncBaseMismatch (nothing applied); the
regroup that follows makes the next update full. Tied weights travel once (plan aliases).

connect/send/receive block: from asyncio code run them with `asyncio.to_thread`. After any
WeightSyncError in a transfer the group's state is unknown: rebuild it under a new epoch.
"""

from rlhf_async.weight_sync.broadcast import (
    DEFAULT_BUCKET_MB,
    ReceivedWeights,
    TorchBroadcastReceiver,
    TorchBroadcastSender,
)
from rlhf_async.weight_sync.errors import (
    WeightSyncBaseMismatch,
    WeightSyncError,
    WeightSyncPlanError,
    WeightSyncSuperseded,
    WeightSyncTimeout,
)
from rlhf_async.weight_sync.interface import (
    WeightReceiver,
    WeightSender,
    backends,
    make_receiver,
    make_sender,
    register_backend,
)
from rlhf_async.weight_sync.joins import Joins
from rlhf_async.weight_sync.module import load_into_module, weights_of
from rlhf_async.weight_sync.plan import tied_names
from rlhf_async.weight_sync.spec import GroupSpec

__all__ = [
    "DEFAULT_BUCKET_MB",
    "GroupSpec",
    "Joins",
    "ReceivedWeights",
    "TorchBroadcastReceiver",
    "TorchBroadcastSender",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncBaseMismatch",
    "WeightSyncError",
    "WeightSyncPlanError",
    "WeightSyncSuperseded",
    "WeightSyncTimeout",
    "backends",
    "load_into_module",
    "make_receiver",
    "make_sender",
    "register_backend",
    "tied_names",
    "weights_of",
]
