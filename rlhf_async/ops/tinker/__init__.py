"""A Tinker-compatible training API (`rlhf-async serve --api HOST:PORT`): the `tinker`
client SDK's HTTP calls served by our models, losses and engines.

    service.py      what each call does (sessions, models, ordered requests, futures)
    server.py       the HTTP side (aiohttp): routes, auth, errors
    training.py     one training client's model (LoRA or full), forward/backward, AdamW
    sampling.py     samplers on our torch generation engine
    checkpoints.py  save_weights / load_weights in our checkpoint format
    losses.py       the server-side losses by name
    proto.py        the protobuf messages, read and written at the wire level
    base_models.py  which base models are served (the built-in tiny one, local, HF cache)
"""
