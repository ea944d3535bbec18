"""Layer 3: RoPE scaling (none, llama, yarn) against transformers' own rotary embedding.

transformers is the reference: its ``ROPE_INIT_FUNCTIONS`` and ``LlamaRotaryEmbedding`` give
the inverse frequencies, the attention factor and the ``cos``/``sin`` this library's
:mod:`torchtitan_spmd.models.rope` must reproduce; and a tiny random transformers Llama with
llama scaling (original context shorter than the sequence) must give this library's logits
after its weights go through the adapter, and different logits without the scaling.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from torchtitan_spmd.models import get_model_spec
from torchtitan_spmd.models.rope import (
    NO_SCALING,
    RopeScaling,
    precompute_rope,
    rope_attention_factor,
    rope_inv_freq,
    rope_scaling_from_hf,
    rope_scaling_to_hf,
)
from torchtitan_spmd.models.state_dict_adapter import HFConfigError

transformers = pytest.importorskip("transformers")

HEAD_DIM = 64
#: name -> transformers rope_parameters (theta 500000, as Llama 3.1; 10000 for the yarn ones).
CASES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3.1": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "llama-short-ctx": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                    "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                    "original_max_position_embeddings": 4096},
    "yarn-attention-factor": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0, "attention_factor": 1.3,
                              "original_max_position_embeddings": 128, "truncate": False},
}


def _hf_llama_config(params: dict[str, Any], max_pos: int = 256) -> Any:
    return transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                                    max_position_embeddings=max_pos, rope_parameters=dict(params))


@pytest.mark.parametrize("case", sorted(CASES))
def test_frequencies_attention_factor_and_tables_match_transformers(case: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _hf_llama_config(CASES[case])
    scaling = rope_scaling_from_hf(config.to_dict())
    theta = CASES[case]["rope_theta"]
    rope_type = CASES[case]["rope_type"]
    if rope_type == "default":
        assert scaling == NO_SCALING
    else:
        theirs, factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        ours = rope_inv_freq(HEAD_DIM, theta, scaling)
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-6, atol=0)
        assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)
    # the tables: transformers' cos/sin are [.., head_dim] = cat(half, half), times its attention factor
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(200)[None]
    cos_t, sin_t = rotary(torch.zeros(1, 200, HEAD_DIM), positions)
    cos, sin = precompute_rope(HEAD_DIM, 200, theta, scaling)
    torch.testing.assert_close(cos, cos_t[0, :, : HEAD_DIM // 2], atol=2e-5, rtol=0)
    torch.testing.assert_close(sin, sin_t[0, :, : HEAD_DIM // 2], atol=2e-5, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_round_trip(case: str) -> None:
    config = _hf_llama_config(CASES[case]).to_dict()
    scaling = rope_scaling_from_hf(config)
    assert rope_scaling_from_hf({"rope_parameters": rope_scaling_to_hf(scaling, 1.0)}) == scaling


def test_older_rope_scaling_field_reads_too() -> None:
    old = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    assert rope_scaling_from_hf(old) == RopeScaling(kind="llama", factor=8.0)


def test_llama_scaling_touches_only_the_low_frequencies() -> None:
    """Llama 3.1: wavelengths under original/high_freq_factor unchanged, over original/low_freq_factor divided."""
    s = RopeScaling(kind="llama", factor=8.0)
    plain, scaled = rope_inv_freq(128, 500000.0), rope_inv_freq(128, 500000.0, s)
    wavelen = 2 * torch.pi / plain
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    assert high.any() and low.any() and (~high & ~low).any()
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)


@pytest.mark.parametrize(("params", "match"), [
    ({"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0},
     r"rope_parameters.rope_type='longrope' is not supported: this library implements 'default', 'llama3', 'yarn'"),
    ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, r"rope_type='dynamic' is not supported"),
    ({"rope_type": "llama3", "rope_theta": 1e4, "original_max_position_embeddings": 16},
     r"rope_type='llama3' needs rope_parameters.factor"),
    ({"rope_type": "llama3", "rope_theta": 1e4, "factor": 2.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 16}, r"0 < low_freq_factor < high_freq_factor"),
])
def test_unsupported_or_broken_scaling_is_one_line_naming_the_field(params: dict[str, Any], match: str) -> None:
    from torchtitan_spmd.models.state_dict_adapter import rope_scaling_of

    with pytest.raises(HFConfigError, match=match):
        rope_scaling_of({"rope_parameters": params}, "config.json")
    with pytest.raises(ValueError, match="RopeScaling.kind='ntk' is not one of"):
        RopeScaling(kind="ntk")  # type: ignore[arg-type]


def _scaled_llama(seed: int = 0) -> Any:
    """A tiny random transformers Llama 3.1-shaped model: llama scaling, original context 16 < seq 48."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.copy_(1 + 0.3 * torch.randn_like(p))
    return model.eval()


def test_scaled_llama_gives_transformers_logits_and_the_scaling_matters() -> None:
    import dataclasses

    hf = _scaled_llama()
    spec = get_model_spec("llama3")
    adapter_cls = spec.state_dict_adapter
    config = adapter_cls.model_config_from_hf(hf.config.to_dict())
    assert config.rope_scaling.kind == "llama" and config.rope_scaling.original_max_position_embeddings == 16
    tokens = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(1))

    def logits(c: Any) -> torch.Tensor:
        model = spec.build(c)
        model.load_state_dict(adapter_cls(c).from_hf(hf.state_dict()), strict=True)
        with torch.no_grad():
            return model(tokens)

    with torch.no_grad():
        want = hf(tokens).logits
    assert (logits(config) - want).abs().max().item() < 1e-4
    unscaled = (logits(dataclasses.replace(config, rope_scaling=NO_SCALING)) - want).abs().max().item()
    assert unscaled > 1e-2, unscaled


@pytest.mark.parametrize(("family", "scaling"), [
    ("llama3", RopeScaling(kind="llama", factor=8.0, original_max_position_embeddings=16)),
    ("qwen3", RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=16)),
    ("llama3", RopeScaling(kind="yarn", factor=40.0, original_max_position_embeddings=8, mscale=1.0,
                           mscale_all_dim=0.5)),
], ids=["llama3-llama", "qwen3-yarn", "llama3-yarn-mscale"])
def test_float64_reference_restates_the_scaling(family: str, scaling: RopeScaling) -> None:
    """The reference's own frequencies give the model's logits; without the scaling they do not."""
    import dataclasses

    from torchtitan_spmd import reference

    spec = get_model_spec(family)
    config = dataclasses.replace(spec.model_config("tiny"), rope_scaling=scaling, max_seq_len=48)
    model = spec.build(config).double()
    model.init_weights(3)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    job = type("Job", (), {"model": type("M", (), {"name": family})(), "debug": None})()
    arch = reference.architecture(job, config)
    tokens = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
    gap = (reference.forward(weights, tokens, arch) - ours).abs().max().item()
    assert gap < 1e-5, gap
    unscaled = dataclasses.replace(arch, rope_scaling=())
    assert (reference.forward(weights, tokens, unscaled) - ours).abs().max().item() > 1e-3


def test_yarn_tables_build_under_a_meta_default_device() -> None:
    """The trainer builds models under ``torch.device("meta")``: YaRN's tables are still computed on
    CPU (every tensor of :func:`rope_inv_freq` takes ``device="cpu"``), equal to a plain build's, and
    the DeepSeek-V3 model (YaRN) builds there, its RoPE buffers on ``meta``."""
    from torchtitan_spmd.models.deepseek_v3 import FLAVORS, DeepSeekV3Model

    scaling = FLAVORS["tiny"].rope_scaling
    assert scaling.kind == "yarn"
    want = precompute_rope(8, 64, 10000.0, scaling)
    with torch.device("meta"):
        got = precompute_rope(8, 64, 10000.0, scaling)
        model = DeepSeekV3Model(FLAVORS["tiny"])
    for g, w in zip(got, want, strict=True):
        assert g.device.type == "cpu" and torch.equal(g, w)
    assert model.rope_cos.is_meta and model.rope_cos.shape == (FLAVORS["tiny"].max_seq_len, 4)
