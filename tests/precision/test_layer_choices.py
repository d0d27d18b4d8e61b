"""keep_bf16 rules checked when a run is submitted (training.setup.check_layer_choices, on a meta-device model)
refuse exactly what apply_recipe refuses when the run starts, with its message; and Q, K and V are fused by default
(on a GPU) only where the rules keep the same layers fused or not."""
from __future__ import annotations

import pytest

from training.config import RunSpec, SpecError
from training.model import build_model, fuse_qkv, meta_model, model_config
from training.precision import apply_recipe
from training.setup import check_layer_choices, fusing_qkv_keeps_the_rules

SPEC = {"model": "tiny", "data": {"corpus": "tinyshakespeare", "vocab_size": 512, "seq_len": 32},
        "recipe": "fp8_tensorwise"}
RULES = [["*.mlp.gate_proj"], ["*.mlp.gate"], ["layers.1.*"], ["layer.1.*"], ["*.q_proj", "*.qkv_proj"],
         ["*.qkv_proj"], ["*.self_attn.*"], ["layers.[01].mlp.down_proj", "layers.9.*"]]


def _spec(rules, **perf) -> RunSpec:
    return RunSpec.from_dict({**SPEC, "keep_bf16": rules, "training": {"perf": perf}}, check_paths=False)


def _at_start(spec: RunSpec, fused: bool) -> str | None:
    model = build_model(model_config(spec.model, spec.vocab_size, spec.data.seq_len), 0)
    if fused:
        fuse_qkv(model)
    try:
        apply_recipe(model, spec.recipe, keep_bf16=spec.keep_bf16)
    except ValueError as e:
        return str(e)
    return None


def _at_submission(spec: RunSpec) -> str | None:
    try:
        check_layer_choices(spec)
    except SpecError as e:
        return str(e)
    return None


@pytest.mark.parametrize("rules", RULES, ids=lambda r: ",".join(r))
@pytest.mark.parametrize("fuse", [None, True, False])
def test_a_rule_is_refused_at_submission_exactly_when_the_worker_would_refuse_it(rules, fuse):
    spec = _spec(rules, **({} if fuse is None else {"fuse_qkv": fuse}))
    said = _at_submission(spec)
    # The worker's model: fused as asked; left out, fused on a GPU where the rules keep the same layers either way.
    forms = [bool(fuse)] if fuse is not None else [False] + (
        [True] if fusing_qkv_keeps_the_rules(meta_model(model_config(spec.model, 512, 32)), rules) else [])
    for fused in forms:
        there = _at_start(spec, fused)
        # the same refusal of the same rules (the names it shows are those of the form the model was built in)
        assert (said is None) == (there is None), (rules, fuse, fused, said, there)
        if said is not None:
            assert said.split("; names look like")[0] == there.split("; names look like")[0]
            assert said == there or (fuse is None and fused), (rules, fuse, fused)
    if said is not None:
        assert said.startswith("keep_bf16 pattern(s) [") and "names look like ['layers.0." in said


def test_whether_fusing_qkv_keeps_what_the_rules_do():
    model = meta_model(model_config(_spec([]).model, 512, 32))
    keeps = {rule: fusing_qkv_keeps_the_rules(model, [rule]) for rule in
             ("layers.1.*", "*.self_attn.*", "*_proj", "*.mlp.*", "*.q_proj", "*.[qkv]_proj", "*.qkv_proj")}
    assert keeps == {"layers.1.*": True, "*.self_attn.*": True, "*_proj": True, "*.mlp.*": True,
                     "*.q_proj": False, "*.[qkv]_proj": False, "*.qkv_proj": False}
    assert fusing_qkv_keeps_the_rules(model, []) and not fusing_qkv_keeps_the_rules(
        model, ["*.q_proj", "*.k_proj", "*.v_proj"])  # Q, K and V kept, but no rule names the fused layer


def test_many_rules_naming_nothing_are_listed_eight_at_most():
    said = _at_submission(_spec([f"layers.{i}.mlp.*" for i in range(40)]))
    assert said.startswith("keep_bf16 pattern(s) ['layers.4.mlp.*', ") and "'layers.11.mlp.*'] and 28 more match no" in said
