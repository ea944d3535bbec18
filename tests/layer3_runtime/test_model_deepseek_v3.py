"""Layer 3: the ``deepseek_v3`` family against the float64 reference and transformers (one process,
but for the sharded load: 4 real forked gloo ranks).

- the model (float64) against :func:`torchtitan_spmd.reference.forward` (MLA, YaRN, DeepSeek routing
  restated there), with every weight perturbed and a random expert bias, for ``tiny``
  (``q_lora_rank`` 16, 4 expert groups, sigmoid, ``route_scale`` 2.5, one shared expert) and for
  its ``q_lora_rank=0`` / softmax / no-group variant; plus one parameter's gradient;
- group-limited routing by hand: a token whose best expert lies in a losing group does not get it;
- transformers' ``DeepseekV3ForCausalLM``: ``tiny`` exported (``to_hf`` + ``hf_config``) opens with
  ``from_pretrained`` with this model's logits; a random transformers model imports
  (``model_config_from_hf`` + ``from_hf``) with its logits; the transformers loss at step 1;
- the trainer's sharded HF load (4 gloo ranks; ``default``: FSDP 2 x TP 2 x EP 4 and FSDP 4,
  ``full_dtensor``: FSDP 4 x EP 4 and FSDP 2 x TP 2; ``spmd_types`` in layer 4): a random
  transformers model saved in bfloat16 loads into the TP-sharded MLA and the EP-sharded experts
  (``--model.flavor from_hf``), the step-1 loss is transformers' cross-entropy of the source, and an
  export right after the load holds exactly the source's tensors (names, dtype, bits);
- the registry: upstream's flavour and recipe names, setup errors naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from deepseek_helpers import check_hf_training, hf_model

from torchtitan_spmd import reference
from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.models import get_model_spec
from torchtitan_spmd.models.deepseek_v3 import (
    FLAVORS,
    DeepSeekV3Config,
    DeepSeekV3Model,
    DeepSeekV3StateDictAdapter,
)
from torchtitan_spmd.models.moe import limit_to_groups
from torchtitan_spmd.models.state_dict_adapter import HFConfigError

#: Relative tolerance of the float64 model against the float64 reference (the RoPE tables are float32).
TOL = 1e-5

VARIANT = dataclasses.replace(FLAVORS["tiny"], q_lora_rank=0, score_func="softmax", n_group=1, topk_group=1,
                              route_norm=False, route_scale=1.0, n_shared_experts=2)


def _perturbed(config: DeepSeekV3Config, seed: int = 5) -> DeepSeekV3Model:
    """``config``'s model (float64), every weight perturbed (norms 1 +- 0.2, matrices + 0.08 N(0, 1)) and
    the expert biases random, so that a weight read from the wrong place shows in the logits."""
    model = DeepSeekV3Model(config)
    model.init_weights(3)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((0.2 if p.dim() == 1 else 0.08) * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model.double()


def _arch(config: DeepSeekV3Config) -> reference.Architecture:
    job = JobConfig()
    job.model.name = "deepseek_v3"
    return reference.architecture(job, config)


def _tokens(seed: int = 0, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, 320, (2, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["tiny", "q_lora_0_softmax"])
def test_the_model_matches_the_reference(name: str) -> None:
    config = FLAVORS["tiny"] if name == "tiny" else VARIANT
    model = _perturbed(config)
    weights = {k: v.detach().clone().requires_grad_(True) for k, v in model.state_dict().items()}
    x = _tokens()
    want = reference.forward(weights, x, _arch(config))
    got = model(x)
    scale = want.abs().max().item()
    gap = (want - got).abs().max().item() / scale
    print(f"\n{name}: max |logit| gap {gap:.1e} of {scale:.2f}")
    assert gap < TOL
    # one tensor's gradient: the replicated low-rank projection feeding every head
    fqn = "layers.1.attention.wkv_a.weight"
    target = torch.randint(0, 320, x.shape, generator=torch.Generator().manual_seed(9))
    F.cross_entropy(want.flatten(0, 1), target.flatten()).backward()
    F.cross_entropy(got.flatten(0, 1), target.flatten()).backward()
    ours = dict(model.named_parameters())[fqn].grad
    theirs = weights[fqn].grad
    assert (ours - theirs).abs().max().item() < TOL * theirs.abs().max().item()


def test_group_limited_routing_skips_the_losing_groups() -> None:
    # 8 experts in 4 groups of 2. Token 0: expert 7 is the best single score, but its group (3: 7 + 6 = 0.95)
    # loses to groups 0 (0.9 + 0.8) and 1 (0.7 + 0.6): only experts 0..3 may be chosen.
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.1, 0.0, 0.0, 0.95]])
    limited = limit_to_groups(scores, n_group=4, topk_group=2)
    assert torch.isinf(limited[0, 4:]).all() and torch.equal(limited[0, :4], scores[0, :4])
    assert limited.topk(2).indices.tolist() == [[0, 1]]
    assert torch.equal(limit_to_groups(scores, n_group=1, topk_group=1), scores)


# ----------------------------------------------------------------------------- transformers
transformers = pytest.importorskip("transformers")


def _save(model: DeepSeekV3Model, config: DeepSeekV3Config, folder: Path) -> None:
    from safetensors.torch import save_file

    adapter = DeepSeekV3StateDictAdapter(config)
    state = adapter.to_hf({k: v.float() for k, v in model.state_dict().items()})
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(adapter.hf_config("float32")))


def test_tiny_exports_for_from_pretrained_with_its_logits(tmp_path: Path) -> None:
    config = FLAVORS["tiny"]
    model = _perturbed(config).float().eval()
    _save(model, config, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    x = _tokens(1)
    with torch.no_grad():
        want, got = hf(x).logits, model(x)
    gap = (want - got).abs().max().item()
    print(f"\nexport: max |logit| gap {gap:.1e} (logits up to {want.abs().max().item():.1f})")
    assert gap < TOL * max(1.0, want.abs().max().item())
    # every expert, the shared experts and the router's correction bias are in the export
    keys = json.loads((tmp_path / "config.json").read_text())
    assert keys["n_routed_experts"] == 8 and keys["rope_parameters"]["rope_type"] == "yarn"
    hf_state = DeepSeekV3StateDictAdapter(config).to_hf(model.state_dict())
    for key in ("model.layers.2.mlp.experts.7.down_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
                "model.layers.2.mlp.gate.e_score_correction_bias", "model.layers.0.mlp.gate_proj.weight",
                "model.layers.0.self_attn.q_a_layernorm.weight", "model.layers.0.self_attn.kv_a_layernorm.weight"):
        assert key in hf_state, key
    back = DeepSeekV3StateDictAdapter(config).from_hf(hf_state)
    for k, v in model.state_dict().items():
        if k in back or not k.endswith("tokens_per_expert"):
            assert back[k].equal(v), k


def test_a_transformers_deepseek_v3_imports_with_its_logits_and_loss(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    hf, _ = hf_model()
    hf.save_pretrained(str(tmp_path))
    config = DeepSeekV3StateDictAdapter.model_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (config.q_lora_rank, config.n_group, config.topk_group, config.route_scale, config.rope_scaling.kind) == (
        0, 4, 2, 2.5, "yarn")
    ours = DeepSeekV3Model(config)
    ours.init_weights(0)
    state = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    missing, unexpected = ours.load_state_dict(DeepSeekV3StateDictAdapter(config).from_hf(state), strict=False)
    assert unexpected == [] and missing == []
    x = _tokens(2, seq=32)
    with torch.no_grad():
        out = hf(x, labels=x)  # transformers shifts the labels itself
        got = ours.eval()(x)
    gap = (out.logits - got).abs().max().item()
    # transformers' own loss against the next-token cross-entropy of this model's logits
    loss = F.cross_entropy(got[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    print(f"\nimport: max |logit| gap {gap:.1e}; loss {loss.item():.6f} vs transformers {out.loss.item():.6f}")
    assert gap < TOL * max(1.0, out.logits.abs().max().item())
    assert abs(loss.item() - out.loss.item()) <= TOL * out.loss.item()


def test_softmax_flavours_have_no_transformers_counterpart() -> None:
    with pytest.raises(HFConfigError, match="score_func='softmax'"):
        DeepSeekV3StateDictAdapter(FLAVORS["debugmodel"]).hf_config()


# ----------------------------------------------------------------------------- registry
def test_upstream_flavours_and_recipes() -> None:
    import torchtitan_spmd.models.deepseek_v3.config_registry as jobs

    spec = get_model_spec("deepseek_v3")
    assert {"debugmodel", "16B", "671B"} <= set(spec.flavors)
    for name in ("deepseek_v3_debugmodel", "deepseek_v3_16b", "deepseek_v3_671b"):
        cfg = getattr(jobs, name)()
        assert cfg.model.name == "deepseek_v3" and cfg.model.flavor in spec.flavors
    big = FLAVORS["671B"]
    assert (big.n_group, big.topk_group, big.route_scale, big.first_k_dense_replace, big.q_lora_rank) == (8, 4, 2.5, 3, 1536)
    with torch.device("meta"):
        n = sum(p.numel() for p in DeepSeekV3Model(big).parameters())
    print(f"\n671B flavour: {n / 1e9:.1f}B parameters (no multi-token prediction module)")
    assert 660e9 < n < 675e9


@pytest.mark.parametrize(("field", "value", "match"), [
    ("n_group", 3, "n_group=3 must divide num_experts=8"),
    ("topk_group", 5, "topk_group=5 must be at most n_group=4"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim=7 must be even"),
    ("q_lora_rank", -1, "q_lora_rank must be an int >= 0"),
])
def test_bad_configs_name_the_field(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(FLAVORS["tiny"], **{field: value})


@pytest.mark.multiproc
@pytest.mark.parametrize(("backend", "layouts"), [("default", ("fsdp2_tp2_ep4", "fsdp4")),
                                                  ("full_dtensor", ("fsdp4_ep4", "fsdp2_tp2"))])
def test_sharded_hf_load_trains_on_transformers_loss(backend: str, layouts: tuple[str, ...], tmp_path: Path) -> None:
    """A random transformers model (bfloat16) loads sharded (TP-sharded MLA, EP-sharded experts or none),
    its step-1 loss is transformers' own, and an export right after the load is the source, bit for bit;
    with and without EP under each backend (``spmd_types``: layer 4's twin)."""
    check_hf_training(backend, layouts, tmp_path)
