"""Paths that arrive through the API are confined to the data directory or PLAB_ALLOWED_PATHS – at submission
and again where a worker's job reads them – with one error whatever exists outside."""
from __future__ import annotations

import pytest

from tests.backend.test_api import EXPERIMENT, make_client
from training.config import CONFINE_ENV, DataSpec, SpecError, confine


@pytest.fixture
def data(tmp_path, monkeypatch):
    root = tmp_path / "data"
    (root / "corpus").mkdir(parents=True)
    (root / "corpus" / "a.txt").write_text("hello")
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "s.txt").write_text("secret words")
    (root / "escape").symlink_to(outside)
    monkeypatch.setenv("PLAB_DATA_DIR", str(root))
    monkeypatch.delenv("PLAB_ALLOWED_PATHS", raising=False)
    return root, outside


def test_the_api_refuses_corpora_outside_the_data_directory(tmp_path, data):
    root, outside = data
    api = make_client(f"sqlite:///{tmp_path / 'plab.sqlite'}", tmp_path)
    messages = set()
    for corpus in ("../../../../tmp/secret", str(outside), "escape", "escape/s.txt", "/etc", "/nonexistent/x"):
        r = api.post("/api/v1/experiments", json={**EXPERIMENT, "data": {"corpus": corpus}})
        assert r.status_code == 422, (corpus, r.text)
        messages.add(r.json()["detail"].replace(repr(corpus), "X"))
    assert len(messages) == 1, messages  # nothing tells an existing folder from a missing one
    assert "inside the data directory or PLAB_ALLOWED_PATHS" in messages.pop()
    for corpus in ("corpus", str(root / "corpus"), "random"):
        r = api.post("/api/v1/experiments", json={**EXPERIMENT, "data": {"corpus": corpus}})
        assert r.status_code == 201, (corpus, r.text)


def test_allowed_paths_extend_the_roots(tmp_path, data, monkeypatch):
    _, outside = data
    monkeypatch.setenv("PLAB_ALLOWED_PATHS", str(outside))
    api = make_client(f"sqlite:///{tmp_path / 'plab.sqlite'}", tmp_path)
    r = api.post("/api/v1/experiments", json={**EXPERIMENT, "data": {"corpus": str(outside)}})
    assert r.status_code == 201, r.text


def test_a_workers_job_confines_again_where_it_reads(data, monkeypatch):
    root, outside = data
    monkeypatch.setenv(CONFINE_ENV, "1")
    with pytest.raises(SpecError, match="inside the data directory"):
        DataSpec(corpus="escape").corpus_dir()
    with pytest.raises(SpecError, match="inside the data directory"):
        DataSpec(corpus=str(outside)).corpus_dir()
    assert DataSpec(corpus="corpus").corpus_dir() == (root / "corpus").resolve()
    monkeypatch.delenv(CONFINE_ENV)
    assert DataSpec(corpus=str(outside)).corpus_dir() == outside  # a local `plab train FILE` reads what it names


def test_the_worker_sets_confinement_and_the_default_data_dir_for_its_jobs(monkeypatch):
    from workers.tasks import job_env

    monkeypatch.delenv("PLAB_DATA_DIR", raising=False)
    env = job_env()
    assert env[CONFINE_ENV] == "1" and env["PLAB_DATA_DIR"]


def test_confine_resolves_dotdot_inside_the_root(data):
    root, _ = data
    assert confine("corpus/../corpus", "data.corpus", [root.resolve()]) == (root / "corpus").resolve()


def test_the_api_confines_model_paths_and_stores_keep_bf16(tmp_path, data):
    root, outside = data
    api = make_client(f"sqlite:///{tmp_path / 'plab.sqlite'}", tmp_path)
    for key in ("config", "init_from"):
        for path in (str(outside), "escape", "../secret"):
            r = api.post("/api/v1/experiments", json={**EXPERIMENT, "model": {key: path}})
            assert r.status_code == 422 and f"model.{key} must be a name or path inside" in r.text, (key, path, r.text)
    body = {**EXPERIMENT, "model": {"init_from": "models/qwen"}, "data": {"corpus": "corpus", "seq_len": 32},
            "recipes": [{"name": "mxfp8", "keep_bf16": ["*.mlp.gate"]}]}
    r = api.post("/api/v1/experiments", json=body)  # this host holds the data directory: the folder is looked at
    assert r.status_code == 422 and "is not a Hugging Face checkpoint folder (no config.json in it)" in r.text
    (root / "models" / "qwen").mkdir(parents=True)
    (root / "models" / "qwen" / "config.json").write_text("{}")  # a folder with a config.json is a checkpoint...
    (root / "models" / "qwen" / "model.safetensors").write_bytes(b"")
    r = api.post("/api/v1/experiments", json=body)  # ...whose config is read for the keep_bf16 rule's layer names
    assert r.status_code == 422 and "model.init_from: cannot read" in r.text and "as a transformers config" in r.text
    from tests.training.tiny_architectures import write_config

    write_config("qwen2_moe", root / "models" / "qwen")  # block 1 is an MoE block: its router is mlp.gate
    typo = {**body, "recipes": [{"name": "mxfp8", "keep_bf16": ["*.mlp.gatee"]}]}
    r = api.post("/api/v1/experiments", json=typo)
    assert r.status_code == 422 and "keep_bf16 pattern(s) ['*.mlp.gatee'] match no linear layer" in r.text, r.text
    r = api.post("/api/v1/experiments", json=body)
    assert r.status_code == 201, r.text
    mx = next(run for run in r.json()["runs"] if run["recipe"] == "mxfp8")
    run = api.get(f"/api/v1/runs/{mx['id']}").json()
    assert run["spec"]["model"] == {"init_from": "models/qwen"} and run["spec"]["keep_bf16"] == ["*.mlp.gate"]
    assert run["label"] == "mxfp8 keep_bf16=*.mlp.gate"


def test_a_file_models_layer_choices_and_context_are_checked_for_each_recipe_at_submission(tmp_path, data):
    """Without keep_bf16 rules too: a model from a config.json is read when the experiment is submitted, so more BF16
    first and last blocks than it has, or a seq_len past its positions, is a 422 now, not a failed run when a worker
    starts it; each recipe's own choices are checked (not only the first recipe's)."""
    from tests.training.tiny_architectures import write_config

    root, _ = data
    write_config("llama", root / "models" / "tiny")  # 2 blocks, 64 positions
    api = make_client(f"sqlite:///{tmp_path / 'plab.sqlite'}", tmp_path)
    body = {**EXPERIMENT, "model": {"config": "models/tiny"}, "data": {"corpus": "corpus", "seq_len": 32}}
    too_many = {**body, "recipes": [{"name": "mxfp8", "bf16_first_layers": 1},
                                    {"name": "nvfp4", "bf16_first_layers": 2, "bf16_last_layers": 1}]}
    r = api.post("/api/v1/experiments", json=too_many)
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == ("the run spec of recipe nvfp4: bf16_first_layers (2) + bf16_last_layers (1) exceeds "
                                  "the model's 2 blocks")
    long = {**body, "data": {"corpus": "corpus", "seq_len": 128}}
    r = api.post("/api/v1/experiments", json=long)
    assert r.status_code == 422 and "data.seq_len (128) exceeds the model's max_position_embeddings (64)" in r.text
    fused = {**body, "model": {"config": write_config("gpt_neox", root / "models" / "neox")},
             "training": {**EXPERIMENT.get("training", {}), "perf": {"fuse_qkv": True}}}
    r = api.post("/api/v1/experiments", json=fused)
    assert r.status_code == 422 and "training.perf.fuse_qkv" in r.text and "GPTNeoXForCausalLM" in r.text, r.text
    assert api.get("/api/v1/experiments").json()["total"] == 0  # nothing stored by a refusal
    fits = {**body, "recipes": [{"name": "mxfp8", "bf16_first_layers": 1, "bf16_last_layers": 1}]}
    assert api.post("/api/v1/experiments", json=fits).status_code == 201


def test_a_workers_job_confines_model_paths_again(data, monkeypatch):
    from training.config import ModelSpec
    _, outside = data
    monkeypatch.setenv(CONFINE_ENV, "1")
    with pytest.raises(SpecError, match="model.init_from must be a name or path inside the data directory"):
        ModelSpec(preset=None, init_from="escape").checkpoint_dir()
    with pytest.raises(SpecError, match="model.config must be a name or path inside the data directory"):
        ModelSpec(preset=None, config=str(outside)).config_file()


@pytest.mark.parametrize("key", ["val_corpus", "tokenizer"])
def test_the_api_confines_the_validation_corpus_and_the_tokenizer_path_too(tmp_path, data, key):
    _, outside = data
    api = make_client(f"sqlite:///{tmp_path / 'plab.sqlite'}", tmp_path)
    r = api.post("/api/v1/experiments", json={**EXPERIMENT, "data": {"corpus": "corpus", key: str(outside)}})
    assert r.status_code == 422, r.text
    assert f"data.{key} must be a name or path inside the data directory" in r.json()["detail"]


def test_the_api_refuses_a_validation_corpus_naming_a_training_file(tmp_path, data):
    root, _ = data
    (root / "held").mkdir()
    (root / "held" / "b.txt").write_text("other words")
    api = make_client(f"sqlite:///{tmp_path / 'plab.sqlite'}", tmp_path)
    r = api.post("/api/v1/experiments", json={**EXPERIMENT, "data": {"corpus": "corpus", "val_corpus": "corpus/a.txt"}})
    assert r.status_code == 422, r.text
    assert "data.val_corpus shares 1 of its 1 file(s) with data.corpus: " in r.json()["detail"]
    assert "leave it out to hold out data.val_fraction" in r.json()["detail"]
    r = api.post("/api/v1/experiments", json={**EXPERIMENT, "data": {"corpus": "corpus", "val_corpus": "held"}})
    assert r.status_code == 201, r.text


def test_a_workers_job_confines_every_file_a_glob_matches(data, monkeypatch):
    root, _ = data
    monkeypatch.setenv(CONFINE_ENV, "1")
    assert DataSpec(corpus="corp*/*.txt").open_corpus().files == [(root / "corpus" / "a.txt").resolve()]
    with pytest.raises(SpecError, match="inside the data directory"):
        DataSpec(corpus="*/s.txt").open_corpus()  # matches escape/s.txt, a link out of the data directory
