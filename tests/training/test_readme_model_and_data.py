"""The README's "Your model and your data" experiment file, as written: the API accepts it, and its run specs
(training shortened) train from a local Qwen2 checkpoint (tiny, built here) on a zstd JSONL corpus named under
PLAB_DATA_DIR."""
from __future__ import annotations

import json
import re

import pytest
import yaml
import zstandard

from tests.conftest import REPO, SHARED_DATA


@pytest.fixture
def readme_experiment() -> dict:
    section = (REPO / "README.md").read_text().split("## Your model and your data", 1)[1]
    return yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))


def test_the_readme_experiment_file_is_accepted_and_trains(readme_experiment, tmp_path, monkeypatch):
    from fastapi.testclient import TestClient
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from backend.app import create_app
    from backend.migrate import upgrade
    from plab.settings import Settings
    from training.corpus import Corpus, list_corpus_files
    from training.sink import ListSink
    from training.tokenizer import get_tokenizer
    from training.train import train

    data = tmp_path / "data"
    monkeypatch.setenv("PLAB_DATA_DIR", str(data))
    checkpoint = data / readme_experiment["model"]["init_from"]
    # 6 blocks: the file's nvfp4 entry keeps the last 4 in BF16, which the API checks against the checkpoint
    Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(checkpoint)
    shakespeare = SHARED_DATA / "tinyshakespeare"
    tokenizer = get_tokenizer(Corpus(list_corpus_files(shakespeare), "text", folder=shakespeare), 512,
                              tmp_path / "cache")
    tokenizer.save_pretrained(checkpoint)
    text = next(shakespeare.rglob("*.txt")).read_text()
    docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    corpus = data / readme_experiment["data"]["corpus"].replace("*", "part-0")
    corpus.parent.mkdir(parents=True)
    field = readme_experiment["data"]["text_field"]
    corpus.write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({field: d}) + "\n" for d in docs).encode()))

    upgrade(f"sqlite:///{tmp_path / 'plab.sqlite'}")
    api = TestClient(create_app(Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'plab.sqlite'}",
                                         broker_url="filesystem://", api_token=None, data_dir=data,
                                         api_url="http://test"), migrate=False))
    r = api.post("/api/v1/experiments", json={**readme_experiment, "enqueue": False})
    assert r.status_code == 201, r.text
    for run in r.json()["runs"][1:3]:  # fp8_tensorwise and the mxfp8 run with its keep_bf16 rule
        spec = api.get(f"/api/v1/runs/{run['id']}").json()["spec"]
        spec["data"]["seq_len"] = 64
        spec["training"].update(steps=3, batch_size=2, warmup_steps=1, val_every=3, val_batches=1,
                                checkpoint_every=0)
        result = train(spec, ListSink(), cache_dir=tmp_path / "cache")
        assert result.status == "succeeded", run["label"]
        assert result.summary["model"]["source"] == "checkpoint"
        assert result.summary["data"]["tokenizer"] == "checkpoint"
