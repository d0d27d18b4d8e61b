"""The run spec: defaults, round trip and validation messages a user can act on."""
import pytest

from training.config import RunSpec, SpecError
from training.model import PRESETS
from training import config as config_module


def test_defaults_follow_the_interface_contract():
    spec = RunSpec.from_dict({})
    d = spec.to_dict()
    assert d["model"] == "tiny" and d["recipe"] == "bf16" and d["seed"] == 0
    assert d["data"] == {"corpus": "tinyshakespeare", "vocab_size": 2048, "seq_len": 128, "val_fraction": 0.02,
                         "tokenizer": "train", "text_field": "text", "val_corpus": None, "num_proc": None,
                         "max_bad_fraction": 0.001, "val_windows": "spread", "eos_at_split": True}
    t = d["training"]
    assert (t["steps"], t["tokens"], t["batch_size"], t["lr"], t["warmup_steps"]) == (200, None, 8, 3e-3, 20)
    assert (t["val_every"], t["val_batches"], t["device"], t["gpus"]) == (50, 4, "auto", 1)


def test_to_dict_round_trips_and_keeps_custom_dims():
    d = {"model": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2},
         "training": {"tokens": 10_000, "batch_size": 4}, "data": {"seq_len": 64}}
    spec = RunSpec.from_dict(d)
    again = RunSpec.from_dict(spec.to_dict())
    assert again == spec
    assert spec.to_dict()["model"]["num_key_value_heads"] == 2


def test_tokens_budget_becomes_steps_rounded_up():
    spec = RunSpec.from_dict({"training": {"tokens": 1000, "batch_size": 2, "warmup_steps": 0},
                              "data": {"seq_len": 64}})
    assert spec.training.steps is None
    assert spec.total_steps == 8  # ceil(1000 / 128)


@pytest.mark.parametrize("d, fragment", [
    ({"training": {"learning_rate": 1e-3}}, "unknown key(s) ['learning_rate'] in training"),
    ({"optimizer": "adam"}, "unknown key(s) ['optimizer'] in run spec"),
    ({"training": {"lr": -1e-3}}, "training.lr must be > 0.0"),
    ({"training": {"steps": 10, "tokens": 100}}, "exactly one of training.steps and training.tokens"),
    ({"model": "7b"}, "unknown model preset '7b'"),
    ({"model": {"hidden_size": 100, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 3}}, "must be divisible by model.num_attention_heads"),
    ({"model": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 3}}, "must be a multiple of"),
    ({"model": {"hidden_size": 64}}, "custom model is missing"),
    ({"data": {"corpus": "no_such_corpus_here"}}, "data.corpus"),
    ({"data": {"corpus": "no_such_corpus_here/*.jsonl"}}, "matches no corpus files"),
    ({"data": {"val_corpus": "no_such_val_corpus"}}, "data.val_corpus"),
    ({"data": {"val_windows": "last"}}, "data.val_windows must be one of ['spread', 'first'], got 'last'"),
    ({"training": {"steps": 10}}, "training.warmup_steps (20, the default) exceeds the run length (10 steps); set "
                                 "training.warmup_steps to at most 10 (e.g. 1, a tenth of the run)"),
    ({"training": {"warmpu_steps": 3}}, "unknown key(s) ['warmpu_steps'] in training; allowed keys are ['activation_"),
    ({"training": {"warmpu_steps": 3}}, "'weight_decay']; did you mean 'warmup_steps'?"),
    ({"data": {"seq_lenn": 3, "vocab_sise": 9}}, "did you mean 'seq_len' (for 'seq_lenn'), 'vocab_size' (for 'vocab_sise')?"),
    ({"data": {"eos_at_split": "yes"}}, "data.eos_at_split must be true or false, got 'yes'"),
    ({"data": {"tokenizer": "checkpoint"}}, "model.init_from, which is not set"),
    ({"data": {"tokenizer": "tinyshakespeare"}}, "is not a tokenizer folder"),
    ({"data": {"tokenizer": 3}}, "data.tokenizer must be"),
    ({"data": {"text_field": ""}}, "data.text_field must be"),
    ({"data": {"num_proc": 0}}, "data.num_proc must be >= 1"),
    ({"data": {"max_bad_fraction": 2}}, "data.max_bad_fraction must be <= 1.0"),
    ({"training": {"batch_size": 6, "grad_accum": 4}}, "must be divisible by grad_accum x gpus"),
    ({"recipe": "fp16"}, "unknown recipe 'fp16'"),
    ({"training": {"steps": 5, "warmup_steps": 10}}, "warmup_steps (10) exceeds"),
    ({"bf16_last_layers": 5}, "exceeds the model's 4 layers"),
    ({"training": {"device": "tpu"}}, "training.device must be"),
    ({"training": {"perf": {"sdpa_backend": "fast"}}}, "training.perf.sdpa_backend must be one of"),
    ({"training": {"param_dtype": "fp16"}}, "training.param_dtype must be one of"),
    ({"training": {"perf": {"ddp_bucket_mb": 0}}}, "training.perf.ddp_bucket_mb"),
    ({"training": {"perf": {"ddp_static_graph": "maybe"}}}, "training.perf.ddp_static_graph"),
    ({"training": {"perf": {"shard_update": "triton"}}}, "training.perf.shard_update must be one of"),
    ({"data": {"vocab_size": 100}}, "data.vocab_size must be >= 300"),
    ({"training": {"batch_size": 2.5}}, "training.batch_size must be an integer"),
    ({"training": {"compile": "yes"}}, "training.compile must be true or false"),
    # a path the system will not look at (a name over 255 bytes): its reason, not an OSError traceback
    ({"data": {"corpus": "a" * 300}}, "cannot be read: File name too long"),
    ({"data": {"val_corpus": "b" * 300}}, "cannot be read: File name too long"),
    ({"data": {"tokenizer": "c" * 300}}, "cannot be read: File name too long"),
    ({"model": {"init_from": "d" * 300}}, "cannot be read: File name too long"),
    ({"model": {"config": "e" * 300}}, "cannot be read: File name too long"),
    ({"data": {"corpus": "tinyshakespear"}}, "did you mean tinyshakespeare?"),
])
def test_invalid_specs_raise_spec_error_saying_what_to_fix(d, fragment):
    with pytest.raises(SpecError) as err:
        RunSpec.from_dict(d)
    assert fragment in str(err.value)


@pytest.mark.parametrize("entry, fragments", [
    ({"name": "nvfp4", "options": {"bf16_last_layers": 4}}, ['recipe: "nvfp4"', "bf16_last_layers: 4"]),
    ({"name": "mxfp8", "options": {"scale_rounding": "even"}, "keep_bf16": ["layers.0.*"]},
     ['recipe: "mxfp8"', 'recipe_options: {"scale_rounding": "even"}', 'keep_bf16: ["layers.0.*"]']),
    ({"name": "bf16", "label": "base", "seeds": [0, 1]}, ['recipe: "bf16"', "label, seeds belong(s) to an experiment"]),
])
def test_an_experiments_recipe_entry_as_recipe_says_how_a_run_spec_spells_it(entry, fragments):
    with pytest.raises(SpecError) as err:
        RunSpec.from_dict({"recipe": entry})
    message = str(err.value)
    assert message.startswith("recipe must be a recipe name (one of bf16, ")
    for fragment in fragments:
        assert fragment in message
    assert "recipe_options: {}" not in message and "bf16_last_layers: 4}" not in message


def test_missing_corpus_can_be_skipped_on_hosts_without_data():
    spec = RunSpec.from_dict({"data": {"corpus": "no_such_corpus_here"}}, check_paths=False)
    assert spec.data.corpus == "no_such_corpus_here"


def test_config_knows_the_same_presets_as_the_model_module():
    assert set(config_module.MODEL_PRESET_NAMES) == set(PRESETS)


def test_an_experiment_given_as_a_run_spec_is_told_how_to_submit_it():
    from training.config import RunSpec, SpecError

    with pytest.raises(SpecError, match=r"unknown key\(s\) \['recipes'\] in run spec; .*this looks like an "
                                        r"experiment \(several recipes\): submit it with `plab submit FILE`"):
        RunSpec.from_dict({"model": "tiny", "data": {"corpus": "tinyshakespeare"}, "recipes": ["bf16"]})
