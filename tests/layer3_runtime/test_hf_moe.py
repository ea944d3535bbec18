"""Layer 3: Hugging Face weights of the MoE flavours, judged by transformers' ``Qwen3MoeForCausalLM``.

- one process, the adapter: a random tiny ``Qwen3MoeForCausalLM`` (``moe_tiny``'s sizes, every
  weight perturbed) imported through ``config.json`` (``--model.flavor from_hf``: the sizes, top-k,
  ``norm_topk_prob``) and ``from_hf`` gives this library's model transformers' logits; this
  library's perturbed ``moe_tiny`` through ``to_hf`` and ``hf_config`` opens with
  ``from_pretrained`` with its logits; unsupported Qwen3Moe variants are named;
- real forked gloo ranks, FSDP 2 x TP 2, ``default`` and ``full_dtensor`` (``spmd_types``:
  ``tests/layer4_spmd_types/test_hf_moe_spmd.py``): the sharded loader reads the per-expert tensors
  into the grouped, FSDP- and TP-sharded experts (the step-1 loss is transformers' cross-entropy of
  the source), an export right after loading holds exactly the source's tensors (names, dtype,
  bits), and the export after training opens with ``from_pretrained`` with this library's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_helpers import TOL, read_safetensors
from hf_moe_helpers import HF_MOE_CONFIG, check_sharded_moe_round_trip, hf_moe_model
from parity_helpers import skip_full_dtensor_on_old_torch
from version_helpers import requires_torch

from torchtitan_spmd.models.qwen3 import FLAVORS, Qwen3Model, Qwen3StateDictAdapter, build_model
from torchtitan_spmd.models.state_dict_adapter import HFConfigError

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(seed))


def test_a_transformers_qwen3_moe_imports_with_its_logits(tmp_path: Path) -> None:
    hf = hf_moe_model()
    hf.save_pretrained(str(tmp_path))
    config = Qwen3StateDictAdapter.model_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    tiny = FLAVORS["moe_tiny"]
    assert (config.num_experts, config.top_k, config.moe_hidden_dim, config.route_norm, config.score_func) == (
        tiny.num_experts, tiny.top_k, tiny.moe_hidden_dim, True, "softmax")
    ours = Qwen3Model(config)
    ours.init_weights(0)
    missing, unexpected = ours.load_state_dict(Qwen3StateDictAdapter(config).from_hf(read_safetensors(tmp_path)),
                                               strict=False)
    assert unexpected == [] and sorted(missing) == [f"layers.{i}.moe.expert_bias" for i in range(2)]
    x = _tokens()
    with torch.no_grad():
        want, got = hf(x).logits, ours.eval()(x)
    gap = (want - got).abs().max().item()
    print(f"\nimport: max |logit| gap {gap:.1e} (logits up to {want.abs().max().item():.1f})")
    assert gap < TOL


def test_moe_tiny_exports_for_from_pretrained_with_its_logits(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    ours = build_model("moe_tiny", seed=3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen) if p.dim() == 1 else 0.08 * torch.randn(p.shape, generator=gen))
    adapter = Qwen3StateDictAdapter(FLAVORS["moe_tiny"])
    hf_state = adapter.to_hf(ours.state_dict())
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in hf_state and not any("bias" in k for k in hf_state)
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config("float32")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    x = _tokens(1)
    with torch.no_grad():
        gap = (hf(x).logits - ours.eval()(x)).abs().max().item()
    assert gap < TOL
    # and back: from_hf(to_hf(state)) is the state (the expert bias aside)
    back = adapter.from_hf(hf_state)
    for k, v in ours.state_dict().items():
        if not k.endswith("expert_bias"):
            assert back[k].equal(v), k


@pytest.mark.parametrize(("field", "value"), [("decoder_sparse_step", 2), ("mlp_only_layers", [0])])
def test_unsupported_qwen3_moe_variants_are_named(field: str, value: object) -> None:
    hf = {**HF_MOE_CONFIG, "model_type": "qwen3_moe", field: value}
    with pytest.raises(HFConfigError, match=f"{field}="):
        Qwen3StateDictAdapter.model_config_from_hf(hf)


@pytest.mark.multiproc
@requires_torch("2.14", "Hugging Face checkpoints (DCP's CheckpointableTensor)")
@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_sharded_moe_weights_in_and_out_match_transformers(backend: str, tmp_path: Path) -> None:
    skip_full_dtensor_on_old_torch(backend, "fsdp2_tp2")
    check_sharded_moe_round_trip(backend, tmp_path)
