"""Any transformers causal-LM architecture, from a config.json or a checkpoint folder (tiny random configs built
here, nothing downloaded): training under every recipe, the conversion report, FLOPs and GEMM shapes against a
count of the matmuls actually run, HF export and reload, continued pre-training from a checkpoint."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tests.training.tiny_architectures import ARCHITECTURES, MORE_ARCHITECTURES, VOCAB, tiny_config, write_config
from training.config import RunSpec, SpecError
from training.sink import ListSink
from training.train import train

RECIPES = ("bf16", "fp8_tensorwise", "fp8_delayed", "mxfp8", "nvfp4")
ARCHS = list(ARCHITECTURES)


def arch_spec(model: dict, recipe: str = "bf16", **training) -> dict:
    return {"model": model, "recipe": recipe, "seed": 3,
            "data": {"corpus": "tinyshakespeare", "vocab_size": VOCAB, "seq_len": 16, "val_fraction": 0.05},
            "training": {"steps": 20, "batch_size": 2, "lr": 3e-3, "warmup_steps": 2, "val_every": 0,
                         "val_batches": 2, "device": "cpu", **training}}


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    return {arch: write_config(arch, root / arch) for arch in ARCHS}


# ------------------------------------------------------------------------------------------------ training
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_trains_20_steps_under_every_recipe(arch, recipe, config_dirs, cache_dir):
    sink = ListSink()
    result = train(arch_spec({"config": config_dirs[arch]}, recipe), sink, cache_dir=cache_dir)
    assert result.status == "succeeded" and result.steps == 20
    # From ln(512) = 6.24 at initialisation, every recipe learns on every architecture: the last five steps' mean
    # loss 0.2 below the first five's (0.29-0.52 measured), the val loss on its fixed windows 0.2 below uniform
    # (0.29-0.66). Not the last step's loss alone: one batch of 32 tokens moves it by 0.1 with the batch.
    losses = [v for _, v in sink.series("train/loss")]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, losses
    assert result.final_val_loss < math.log(VOCAB) - 0.2
    info = result.summary["model"]
    assert info["architecture"] == type(tiny_config(arch)).__name__.replace("Config", "ForCausalLM")
    assert info["source"] == "config" and info["origin"] == config_dirs[arch] and info["params"] > 0
    converted = [layer for layer in result.conversion_report if layer["converted"]]
    assert (len(converted) > 0) == (recipe != "bf16")


# ------------------------------------------------------------------------------------ conversion report
def config_ties(arch: str) -> bool:
    return bool(tiny_config(arch).tie_word_embeddings)


def _fresh(arch: str, **overrides):
    from training.model import build_model, prepare_for_training
    config = prepare_for_training(tiny_config(arch))
    for key, value in overrides.items():  # e.g. the eager attention whose matmuls a counter sees
        setattr(config, key, value)
    return build_model(config, seed=0)


@pytest.mark.parametrize("arch", ARCHS + list(MORE_ARCHITECTURES))
def test_conversion_report_lists_every_linear_with_its_reason(arch):
    from training.model import decoder_blocks
    from training.precision import apply_recipe
    model = _fresh(arch)
    block_linears = [f"layers.{i}.{path}" for i, block in enumerate(decoder_blocks(model))
                     for path, m in block.named_modules() if type(m) is nn.Linear]
    keep = {"qwen2_moe": ["*.mlp.shared_expert_gate", "*.mlp.gate"], "mixtral": ["*.mlp.gate"]}.get(arch, [])
    report = apply_recipe(model, "mxfp8", bf16_last_layers=1, keep_bf16=keep)
    by_name = {layer["name"]: layer for layer in report.layers}
    assert set(block_linears) <= set(by_name)
    blocks = decoder_blocks(model)
    for name in block_linears:
        layer = by_name[name]
        module = blocks[layer["block"]].get_submodule(name.split(".", 2)[2])
        assert layer["converted"] == (type(module) is not nn.Linear)
        if layer["block"] == 1:
            assert not layer["converted"] and "bf16_last_layers=1" in layer["reason"]
        elif "shared_expert_gate" in name:
            assert layer["reason"] == "kept in BF16: matches keep_bf16 rule '*.mlp.shared_expert_gate'"
        else:
            assert layer["converted"], layer
    outside = [layer for layer in report.layers if layer["block"] is None]
    assert [layer["reason"] for layer in outside] == [
        "kept in BF16 by convention: LM head",
        "kept in BF16 by convention: embeddings" + (" (tied to the LM head)" if config_ties(arch) else "")]
    assert not any(layer["converted"] for layer in outside)
    if arch in ("qwen2_moe", "mixtral"):  # experts are batched 3-D tensors in transformers 5: kept, and said why
        moe_blocks = [1] if arch == "qwen2_moe" else [0, 1]  # Qwen2-MoE's block 0 is dense (mlp_only_layers)
        experts = [layer for layer in report.layers if ".experts." in layer["name"]]
        assert {layer["name"] for layer in experts} == {f"layers.{i}.mlp.experts.{w}" for i in moe_blocks
                                                        for w in ("gate_up_proj", "down_proj")}
        assert all("batched expert weights" in layer["reason"] and not layer["converted"] for layer in experts)
        router = by_name[f"layers.{moe_blocks[0]}.mlp.gate.weight"]
        assert "TopKRouter, not an nn.Linear" in router["reason"]


def test_a_keep_bf16_rule_that_matches_nothing_is_refused_with_the_names_it_could_match():
    from training.precision import apply_recipe
    with pytest.raises(ValueError, match=r"keep_bf16 pattern\(s\) \['\*\.mlp\.gat'\] match no linear.*layers\.0\."):
        apply_recipe(_fresh("llama"), "mxfp8", keep_bf16=["*.mlp.gat"])
    with pytest.raises(SpecError, match="keep_bf16 must be a list of glob patterns"):
        RunSpec.from_dict({"keep_bf16": "*.mlp.gate"})
    assert RunSpec.from_dict({"keep_bf16": ["*.mlp.gate"]}).to_dict()["keep_bf16"] == ["*.mlp.gate"]
    assert "keep_bf16" not in RunSpec.from_dict({}).to_dict()  # specs stored before the option stay equal


# ------------------------------------------------------------------------------ FLOPs and GEMM shapes
class _MatmulShapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Every 2-D matmul that runs, as (m, k, n)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func._overloadpacket
        if packet is torch.ops.aten.mm:
            self.shapes.append((args[0].shape[0], args[0].shape[1], args[1].shape[1]))
        elif packet is torch.ops.aten.addmm:
            self.shapes.append((args[1].shape[0], args[1].shape[1], args[2].shape[1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ARCHS + list(MORE_ARCHITECTURES))
def test_flops_and_gemm_shapes_equal_the_matmuls_of_one_forward_and_backward(arch):
    from training.flops import flops_per_token
    from training.gemm import gemm_shapes
    from training.model import CausalLMLoss, fuse_gate_up, fuse_qkv
    micro_batch, seq = 2, 16
    # Eager attention computes the whole masked T x T matrix, sliding layers too, while the count takes a sliding
    # layer's window (training.flops, tested on its own in test_flops_mfu.py): a window of the sequence's length
    # makes the two the same work, so the counter checks everything else.
    window = {"sliding_window": seq} if getattr(tiny_config(arch), "sliding_window", None) else {}
    model = _fresh(arch, _attn_implementation="eager", _experts_implementation="eager", **window)
    if arch == "llama":  # a Llama config's GEMMs are those of the fused QKV and gate/up of a GPU run
        fuse_qkv(model), fuse_gate_up(model)
    ids = torch.randint(0, VOCAB, (micro_batch, seq + 1), generator=torch.Generator().manual_seed(0))
    loss_module = CausalLMLoss(model, fused_loss=False)
    with FlopCounterMode(display=False) as counter, _MatmulShapes() as seen:
        loss_module(ids[:, :-1], ids[:, 1:]).backward()
    # The formula is derived from a config (built on the meta device), not from the model that ran.
    config = tiny_config(arch, **window)
    assert flops_per_token(config, seq) * micro_batch * seq == counter.get_total_flops()
    shapes = gemm_shapes(config, micro_batch, seq)
    assert sum(s.flops * s.count for s in shapes) == 2 * sum(m * k * n for m, k, n in seen.shapes)
    if arch not in ("qwen2_moe", "mixtral"):  # an MoE's per-expert rows depend on the routing; their sum does not
        expected = sorted((s.m, s.k, s.n) for s in shapes for _ in range(s.count))
        assert sorted(seen.shapes) == expected


def test_gemm_shapes_of_a_llama_config_are_its_fused_modules():
    """The Llama formula (QKV and gate/up as one GEMM each) is what a model with fuse_qkv and fuse_gate_up runs."""
    from training.gemm import gemm_shapes
    from training.gemm.shapes import model_gemm_shapes
    from training.model import fuse_gate_up, fuse_qkv, meta_model
    config = tiny_config("llama")
    model = meta_model(config)
    fuse_qkv(model), fuse_gate_up(model)
    by_formula = sorted((s.gemm, s.m, s.k, s.n, s.count) for s in gemm_shapes(config, 2, 16))
    assert by_formula == sorted((s.gemm, s.m, s.k, s.n, s.count) for s in model_gemm_shapes(model, 2, 16))


# ------------------------------------------------------------------------------ export, reload, resume
def _short_run(model: dict, output_dir, cache_dir, recipe: str = "bf16", steps: int = 3):
    return train(arch_spec(model, recipe, steps=steps, warmup_steps=1), output_dir=output_dir, cache_dir=cache_dir)


def _prepared_run(spec_dict: dict, cache_dir):
    from training.setup import join_processes, setup_run
    from training.sink import NullSink
    spec = RunSpec.from_dict(spec_dict)
    ctx = join_processes(spec)
    return spec, ctx, setup_run(spec, ctx, NullSink(), cache_dir=cache_dir)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_exported_checkpoint_loads_with_plain_transformers_and_gives_the_same_logits(arch, config_dirs,
                                                                                         cache_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from training.checkpoint import Checkpointer, TrainState
    from training.sink import NullSink
    result = _short_run({"config": config_dirs[arch]}, tmp_path, cache_dir)
    hf, info = AutoModelForCausalLM.from_pretrained(result.checkpoint_dir, dtype=torch.float32,
                                                    output_loading_info=True)
    assert type(hf).__name__ == result.summary["model"]["architecture"]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # The run's own model, given the checkpoint's weights by the loop's resume path.
    spec, ctx, run = _prepared_run(arch_spec({"config": config_dirs[arch]}, steps=3, warmup_steps=1), cache_dir)
    Checkpointer(tmp_path, spec=spec, ctx=ctx, sink=NullSink(), model=run.model, optimizer=run.optimizer).resume(
        TrainState())
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(run.model.eval()(input_ids=ids).logits, hf.eval()(input_ids=ids).logits)


def test_a_low_precision_moe_checkpoint_holds_the_master_weights(config_dirs, cache_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    result = _short_run({"config": config_dirs["qwen2_moe"]}, tmp_path, cache_dir, recipe="nvfp4")
    hf = AutoModelForCausalLM.from_pretrained(result.checkpoint_dir, dtype=torch.float32)
    saved = load_file(f"{result.checkpoint_dir}/model.safetensors")
    state = hf.state_dict()
    assert saved.keys() <= state.keys() and all(torch.equal(state[k], v) for k, v in saved.items())
    initial = _fresh("qwen2_moe").state_dict()  # training moved every weight, converted layers' included
    assert not torch.equal(state["model.layers.0.mlp.down_proj.weight"], initial["model.layers.0.mlp.down_proj.weight"])


def _step0_val_loss(spec_dict: dict, cache_dir):
    from training.validation import ValidationLoss
    spec, ctx, run = _prepared_run(spec_dict, cache_dir)
    t = spec.training
    validation = ValidationLoss(run.eval_net, run.model, run.dataset.val_windows(t.val_batches * t.batch_size),
                                micro_batch=run.micro_batch, device=run.device, ctx=ctx, autocast=run.autocast,
                                settle=run.settle)
    weights = {n: (p.dequantize() if hasattr(p, "dequantize") else p).detach().clone()
               for n, p in run.model.named_parameters()}
    return validation.loss(), weights, run


def test_init_from_a_checkpoint_starts_every_recipe_from_its_weights_and_its_validation_loss(
        config_dirs, cache_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    first = _short_run({"config": config_dirs["qwen2"]}, tmp_path / "first", cache_dir)
    # The same checkpoint re-saved in shards (model.safetensors.index.json): a folder as users have them.
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(first.checkpoint_dir).save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # its tokenizer: data.tokenizer defaults to "checkpoint"
        shutil.copy(Path(first.checkpoint_dir) / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    saved = load_file(f"{first.checkpoint_dir}/model.safetensors")
    for folder in (first.checkpoint_dir, str(sharded)):
        starts = {}
        for recipe in RECIPES:
            spec = arch_spec({"init_from": folder}, recipe, steps=3, warmup_steps=1)
            loss, weights, run = _step0_val_loss(spec, cache_dir)
            starts[recipe] = weights
            assert run.model_info["source"] == "checkpoint" and run.model_info["origin"] == folder
            if recipe == "bf16":
                assert loss == first.final_val_loss  # the checkpoint's own validation loss, exactly
        for recipe, weights in starts.items():
            assert all(torch.equal(weights[k], v) for k, v in saved.items() if k in weights), recipe
            assert weights.keys() == starts["bf16"].keys()
    resumed = train(arch_spec({"init_from": first.checkpoint_dir}, "mxfp8", steps=3, warmup_steps=1),
                    cache_dir=cache_dir)
    assert resumed.status == "succeeded" and resumed.summary["model"]["source"] == "checkpoint"
    assert resumed.final_val_loss < first.final_val_loss + 0.5
    # The context each was trained on, for the evaluation's windows: the run's seq_len from random weights, the
    # longer of the two when training continues, nothing for a pretrained checkpoint that does not say
    from training.model import TRAINED_CONTEXT_ATTR, model_config

    def context(folder, seq_len):
        spec = RunSpec.from_dict({**arch_spec({"init_from": str(folder)}), "data": {"seq_len": seq_len}})
        return getattr(model_config(spec.model, VOCAB, seq_len), TRAINED_CONTEXT_ATTR, None)

    for folder in (first.checkpoint_dir, sharded):
        assert json.loads((Path(folder) / "config.json").read_text())[TRAINED_CONTEXT_ATTR] == 16
    assert (context(first.checkpoint_dir, 8), context(first.checkpoint_dir, 64)) == (16, 64)
    config = json.loads((sharded / "config.json").read_text())
    del config[TRAINED_CONTEXT_ATTR]
    (sharded / "config.json").write_text(json.dumps(config))
    assert context(sharded, 64) is None


# ----------------------------------------------------------------------------------------- refusals
def test_llama_only_perf_switches_are_refused_on_other_architectures(config_dirs, cache_dir):
    for switch in ("fuse_qkv", "fuse_gate_up"):
        with pytest.raises(SpecError, match=rf"training.perf.{switch} .* works on Llama models only, and this "
                                            r"model is Qwen2ForCausalLM; set training.perf.\w+ to false"):
            train(arch_spec({"config": config_dirs["qwen2"]}, steps=2, warmup_steps=1, perf={switch: True}),
                  cache_dir=cache_dir)


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused_before_training(tmp_path, cache_dir):
    tiny_config("qwen3", vocab_size=400).save_pretrained(tmp_path)
    with pytest.raises(SpecError, match=r"the tokenizer has 512 tokens but the model's vocabulary is only 400 "
                                        r"\(Qwen3Config\); use a tokenizer of at most 400 tokens"):
        train(arch_spec({"config": str(tmp_path)}), cache_dir=cache_dir)


@pytest.mark.parametrize("model, message", [
    ({"config": "no/such/dir"}, r"model.config 'no/such/dir': .* does not exist; give a config.json"),
    ({"init_from": "tinyshakespeare"}, r"is not a Hugging Face checkpoint folder \(no config.json in it\)"),
    ({"config": "x", "hidden_size": 64}, "model as a file takes exactly one key"),
    ({"config": "x", "init_from": "y"}, "model as a file takes exactly one key"),
    ({"config": 3}, "model.config must be a path"),
])
def test_bad_model_paths_are_refused_with_a_fix(model, message):
    with pytest.raises(SpecError, match=message):
        RunSpec.from_dict({"model": model})


def test_model_paths_from_the_api_are_confined(tmp_path):
    from training.config import confine_spec_paths
    inside = tmp_path / "models" / "qwen"
    inside.mkdir(parents=True)
    confine_spec_paths({"model": {"init_from": str(inside)}}, [tmp_path])
    for key in ("config", "init_from"):
        with pytest.raises(SpecError, match=f"model.{key} must be a name or path inside the data directory"):
            confine_spec_paths({"model": {key: str(tmp_path / ".." / "elsewhere")}}, [tmp_path])


def test_a_config_without_a_causal_lm_class_is_refused(tmp_path):
    from transformers import ViTConfig

    from training.model import model_config
    ViTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64).save_pretrained(tmp_path)
    spec = RunSpec.from_dict({"model": {"config": str(tmp_path)}})
    with pytest.raises(SpecError, match="model type 'vit' has no causal-LM class"):
        model_config(spec.model, 512, 16)


@pytest.mark.slow  # ~30 s, most of it importing lm-eval
def test_plab_eval_runs_on_a_non_llama_checkpoint(config_dirs, cache_dir, tmp_path):
    import json
    import math

    from plab.cli.evaluate import cmd_eval
    result = _short_run({"config": config_dirs["gpt_neox"]}, tmp_path / "run", cache_dir)
    out = tmp_path / "eval.json"
    assert cmd_eval([result.checkpoint_dir, "--tasks", "plab_lambada_openai", "--limit", "3", "--device", "cpu",
                     "--output", str(out)]) == 0
    metrics = json.loads(out.read_text())["tasks"]["plab_lambada_openai"]["metrics"]
    assert metrics and all(math.isfinite(m["value"]) for m in metrics.values())


# --------------------------------------------------------------------- perf switches on other architectures
@pytest.mark.parametrize("arch", ["gpt_neox", "qwen2_moe", "gemma2"])
def test_activation_checkpointing_changes_no_number_on_other_architectures(arch, config_dirs, cache_dir):
    runs = [train(arch_spec({"config": config_dirs[arch]}, steps=4, warmup_steps=1, activation_checkpointing=mode),
                  cache_dir=cache_dir) for mode in ("none", "full")]
    assert runs[0].final_loss == runs[1].final_loss and runs[1].summary["activation_checkpointing"]["blocks"] == 2


@pytest.mark.slow  # ~75 s of inductor compilation on CPU
def test_per_layer_compilation_trains_a_non_llama_model_like_eager(config_dirs, cache_dir):
    eager, compiled = (train(arch_spec({"config": config_dirs["qwen3"]}, steps=4, warmup_steps=1, **extra),
                             cache_dir=cache_dir)
                       for extra in ({}, {"compile": True, "perf": {"compile_scope": "layers"}}))
    assert compiled.status == "succeeded" and compiled.final_loss == pytest.approx(eager.final_loss, rel=1e-5)


def test_the_gemm_benchmark_times_the_gemms_of_a_config_file_of_any_architecture(config_dirs):
    from training.gemm import gemm_shapes, run_gemm_benchmark
    config_file = f"{config_dirs['qwen2_moe']}/config.json"
    result = run_gemm_benchmark(config_file, micro_batch=1, seq_len=16, formats="bf16", device="cpu",
                                repeats=1, warmup=0)
    timed = {(r["layer"], r["gemm"], r["m"], r["k"], r["n"]) for r in result["results"]}
    expected = {(s.layer, s.gemm, s.m, s.k, s.n) for s in gemm_shapes(tiny_config("qwen2_moe"), 1, 16)}
    assert timed == expected and ("mlp.experts.gate_up_proj", "fprop", 32, 64, 64) in timed  # 16 tokens x top-2
    assert all(r["time_s"] and r["time_s"] > 0 for r in result["results"])


@pytest.mark.slow  # two gloo processes per architecture
@pytest.mark.parametrize("arch", ["qwen2", "qwen2_moe"])
def test_fsdp_on_2_processes_shards_and_exports_a_non_llama_model(arch, config_dirs, cache_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.training.test_fsdp import _job, _launch, _result
    spec = arch_spec({"config": config_dirs[arch]}, "bf16", steps=3, warmup_steps=1, batch_size=4,
                     gpus=2, parallel="fsdp")
    _launch(2, [_job(spec, tmp_path, "fsdp", cache_dir)], tmp_path, "fsdp")
    sharded = _result(tmp_path, "fsdp")
    single = train(arch_spec({"config": config_dirs[arch]}, "bf16", steps=3, warmup_steps=1, batch_size=4),
                   cache_dir=cache_dir)
    assert sharded["status"] == "succeeded" and sharded["summary"]["parallel"] == "fsdp"
    assert sharded["final_loss"] == pytest.approx(single.final_loss, abs=1e-5)
    hf = AutoModelForCausalLM.from_pretrained(sharded["checkpoint_dir"])
    assert type(hf).__name__ == sharded["summary"]["model"]["architecture"]


def test_a_checkpoint_missing_a_weight_is_refused_not_filled_at_random(tmp_path):
    from safetensors.torch import load_file, save_file

    from training.model import load_pretrained, model_config
    _fresh("qwen3").save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    spec = RunSpec.from_dict({"model": {"init_from": str(tmp_path)}})
    config = model_config(spec.model, 512, 16)
    with pytest.raises(SpecError, match=r"lacks weights \['model.layers.1.mlp.down_proj.weight'\]"):
        load_pretrained(spec.model.checkpoint_dir(), config, seed=0)


def test_a_checkpoint_named_under_the_data_directory_brings_its_tokenizer(config_dirs, cache_dir, tmp_path,
                                                                           monkeypatch):
    """`model.init_from: models/NAME` (a name under PLAB_DATA_DIR, as the README's example has it): the weights
    and, by default, the tokenizer come from that folder, whatever the working directory; a folder without a
    tokenizer is a spec error that says so."""
    import shutil as sh

    first = _short_run({"config": config_dirs["qwen2"]}, tmp_path / "first", cache_dir)
    data = tmp_path / "data"
    sh.copytree(first.checkpoint_dir, data / "models" / "mine")
    sh.copytree(Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare",
                data / "tinyshakespeare")
    monkeypatch.setenv("PLAB_DATA_DIR", str(data))
    monkeypatch.chdir(tmp_path)
    result = train(arch_spec({"init_from": "models/mine"}, "fp8_tensorwise", steps=2, warmup_steps=1),
                   cache_dir=cache_dir)
    assert result.status == "succeeded" and result.summary["data"]["tokenizer"] == "checkpoint"
    (data / "models" / "mine" / "tokenizer.json").unlink()
    (data / "models" / "mine" / "tokenizer_config.json").unlink()
    with pytest.raises(SpecError, match="data.tokenizer: .*holds no tokenizer"):
        train(arch_spec({"init_from": "models/mine"}, "bf16", steps=2), cache_dir=cache_dir)
