"""The user's rows from every source `task/sources/dataset.py` reads: .jsonl/.txt natively; .json,
.parquet, .arrow, .csv, save_to_disk directories, data-file folders and dataset ids in a
fake local HF cache through `datasets`; each bad source one clear ConfigError."""

from __future__ import annotations

import json
import shutil

import pytest
from huggingface_hub import constants

from rlhf_async.config import ConfigError, load_config
from rlhf_async.task.sources.dataset import load_rows
from tests.fake_hub import fake_snapshot

datasets = pytest.importorskip("datasets")
ROWS = [{"prompt": "name a fruit .", "kind": "fruit"}, {"prompt": "name a colour .",
                                                        "kind": "colour"}]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    (d / "rows.json").write_text(json.dumps(ROWS))
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(d / "rows.parquet"))
    ds.to_csv(str(d / "rows.csv"), index=False)
    ds.save_to_disk(str(d / "saved"))
    shutil.copy(next((d / "saved").glob("*.arrow")), d / "rows.arrow")
    datasets.DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(d / "dict"))
    (d / "files" / "data").mkdir(parents=True)
    ds.to_parquet(str(d / "files" / "data" / "train.parquet"))
    return d


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "rows.parquet", "rows.arrow",
                                  "rows.csv", "saved", "dict", "files"])
def test_every_source_gives_the_same_rows(sources, name):
    assert load_rows(str(sources / name), "task.prompts") == ROWS


def test_a_split_is_chosen_by_name_and_a_missing_one_is_listed(sources):
    assert load_rows(str(sources / "dict"), "sft.data", "test") == ROWS[1:]
    with pytest.raises(ConfigError, match=r"sft.data: .*dict' has no split 'dev' \(sft.split\)"
                       r"; its splits: \['test', 'train'\]"):
        load_rows(str(sources / "dict"), "sft.data", "dev")


def test_text_lines_fill_one_column(tmp_path):
    (tmp_path / "p.txt").write_text("one\n\n two \n")
    assert load_rows(str(tmp_path / "p.txt"), "task.prompts", text_column="q") == [
        {"q": "one"}, {"q": "two"}]


def test_bad_sources_are_one_clear_error(tmp_path, sources):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="task.prompts: .*empty.jsonl' holds no rows"):
        load_rows(str(tmp_path / "empty.jsonl"), "task.prompts")
    (tmp_path / "list.jsonl").write_text('["a"]\n')
    with pytest.raises(ConfigError, match="list.jsonl:1: expected a JSON object, got list"):
        load_rows(str(tmp_path / "list.jsonl"), "task.prompts")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match="task.prompts: cannot read .*bad.parquet' as a "
                       "dataset"):
        load_rows(str(tmp_path / "bad.parquet"), "task.prompts")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = fake_snapshot(cache, "dataset", "acme/prompts")
    (snap / "data").mkdir()
    datasets.Dataset.from_list(ROWS).to_parquet(str(snap / "data" / "train.parquet"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snap


def test_a_cached_dataset_id_is_read_from_its_snapshot(hub_cache):
    cfg = load_config(None, ["sft.data=acme/prompts", "reward_model.data=acme/prompts"])
    assert cfg.sft.data == cfg.reward_model.data == str(hub_cache)
    assert load_rows(cfg.sft.data, "sft.data") == ROWS


def test_a_dataset_id_not_in_the_cache_names_what_to_download(hub_cache):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["sft.data=acme/absent"])
    assert "sft.data: 'acme/absent' is neither a file, a directory nor a dataset in the " \
           "local Hugging Face cache" in str(e.value)
    assert "huggingface-cli download --repo-type dataset acme/absent" in str(e.value)
