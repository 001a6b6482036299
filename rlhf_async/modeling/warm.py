"""Importing this module loads a tiny model (`modeling.models.warm_loading`): only the fork
server imports it (`launcher.PRELOAD`), after torch and transformers, so that the nodes and
ranks forked from it skip transformers' first-load cost (~0.3 s each)."""

from rlhf_async.modeling.models import warm_loading

warm_loading()
