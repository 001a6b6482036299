"""Model paths by hub id, from a local Hugging Face cache laid out as huggingface_hub
writes it (models--org--name/refs/main -> snapshots/<commit>/); never downloaded."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import constants

from rlhf_async.config import ConfigError, load_config
from tests.fake_hub import fake_snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = fake_snapshot(cache, "model", "acme/tiny-chat")
    (snap / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 64}))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snap


def test_a_cached_hub_id_becomes_its_snapshot_directory(hub_cache):
    cfg = load_config(None, ["model.path=acme/tiny-chat"])
    assert cfg.model.path == str(hub_cache)


def test_a_hub_id_not_in_the_cache_names_what_to_download(hub_cache):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.path=acme/absent"])
    text = str(e.value)
    assert "model.path: 'acme/absent' is neither a directory nor a model in the local " \
           "Hugging Face cache" in text
    assert "huggingface-cli download acme/absent" in text and str(hub_cache.parents[2]) in text


def test_a_local_directory_wins_over_a_hub_id_of_the_same_name(hub_cache, tmp_path,
                                                               monkeypatch):
    (tmp_path / "acme" / "tiny-chat").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert load_config(None, ["model.path=acme/tiny-chat"]).model.path == "acme/tiny-chat"
