"""The Qwen3-style model: sizes, QK RMSNorm per head, rotate-half RoPE, decoupled head width,
causality and init determinism, each against a hand-written reference."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from torchtitan_spmd.models.common import count_parameters, precompute_rope
from torchtitan_spmd.models.qwen3 import (
    FLAVORS,
    Qwen3Attention,
    Qwen3Config,
    Qwen3Model,
    apply_rotary_emb_half,
    build_model,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def expected_param_count(c: Qwen3Config) -> int:
    """Hand formula: embeddings + output + final norm + n_layers blocks."""
    attention = 2 * c.dim * c.n_heads * c.head_dim + 2 * c.dim * c.n_kv_heads * c.head_dim
    # a dense SwiGLU, or the router's gate and num_experts SwiGLUs
    ffn = 3 * c.dim * c.hidden_dim if not c.num_experts else c.dim * c.num_experts * (1 + 3 * c.moe_hidden_dim)
    block = attention + 2 * c.head_dim + ffn + 2 * c.dim  # + QK norms, norms
    embeddings = (1 if c.enable_weight_tying else 2) * c.vocab_size * c.dim  # tied: one tensor
    return embeddings + c.n_layers * block + c.dim


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_param_count_matches_formula(flavor: str) -> None:
    with torch.device("meta"):  # debugmodel_moe has 315M parameters
        model = Qwen3Model(FLAVORS[flavor])
    assert count_parameters(model) == expected_param_count(FLAVORS[flavor])


def test_debugmodel_size_and_decoupled_heads() -> None:
    c = FLAVORS["debugmodel"]
    assert count_parameters(build_model("debugmodel", seed=0)) == 6_066_176
    assert c.n_heads * c.head_dim != c.dim  # head width is its own hyper-parameter
    attn = build_model("tiny", seed=0).layers["0"].attention
    t = FLAVORS["tiny"]
    assert attn.wq.weight.shape == (t.n_heads * t.head_dim, t.dim)
    assert attn.wo.weight.shape == (t.dim, t.n_heads * t.head_dim)
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (t.head_dim,)


@pytest.mark.parametrize("kwargs", [{"n_kv_heads": 3}, {"head_dim": 15}, {"dim": 0}, {"norm_eps": 0.0}])
def test_bad_config_raises(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="Qwen3Config"):
        replace(FLAVORS["tiny"], **kwargs)


def test_rotate_half_matches_complex_rotation() -> None:
    head_dim, seq = 16, 10
    cos, sin = precompute_rope(head_dim, 32, 1e6)
    x = torch.randn(2, seq, 3, head_dim, generator=torch.Generator().manual_seed(0))
    out = apply_rotary_emb_half(x, cos[:seq], sin[:seq])
    # The halves are the real and imaginary parts of head_dim/2 complex numbers.
    xc = torch.complex(x[..., : head_dim // 2], x[..., head_dim // 2 :])
    freqs = torch.polar(torch.ones(seq, head_dim // 2), torch.atan2(sin[:seq], cos[:seq]))
    rotated = xc * freqs.view(1, seq, 1, -1)
    torch.testing.assert_close(out, torch.cat([rotated.real, rotated.imag], dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 0], x[:, 0])  # position 0 is the identity


def reference_attention(attn: Qwen3Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """Per-head RMSNorm of q and k (over head_dim), rotate-half RoPE, explicit causal softmax."""
    bs, seq, _ = x.shape
    hd = attn.head_dim

    def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps) * w

    def rope(t: torch.Tensor) -> torch.Tensor:
        a, b = t[..., : hd // 2], t[..., hd // 2 :]
        c, s = cos.view(1, seq, 1, -1), sin.view(1, seq, 1, -1)
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    q = rope(rms(attn.wq(x).view(bs, seq, attn.n_heads, hd), attn.q_norm.weight))
    k = rope(rms(attn.wk(x).view(bs, seq, attn.n_kv_heads, hd), attn.k_norm.weight))
    v = attn.wv(x).view(bs, seq, attn.n_kv_heads, hd)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    heads = []
    for h in range(attn.n_heads):
        kv = h // (attn.n_heads // attn.n_kv_heads)
        scores = q[:, :, h] @ k[:, :, kv].transpose(1, 2) / math.sqrt(hd)
        heads.append(scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, :, kv])
    return attn.wo(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 2), (4, 4), (4, 1)])
def test_attention_matches_reference_with_qk_norm(n_heads: int, n_kv_heads: int) -> None:
    config = replace(FLAVORS["tiny"], n_heads=n_heads, n_kv_heads=n_kv_heads)
    model = Qwen3Model(config)
    model.init_weights(0)
    attn = model.layers["0"].attention
    with torch.no_grad():  # non-trivial QK-norm scales, different for q and k
        attn.q_norm.weight.copy_(torch.linspace(0.5, 2.0, config.head_dim))
        attn.k_norm.weight.copy_(torch.linspace(2.0, 0.25, config.head_dim))
    x = torch.randn(2, 11, config.dim, generator=torch.Generator().manual_seed(0))
    cos, sin = model.rope_cos[:11], model.rope_sin[:11]
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin), reference_attention(attn, x, cos, sin, config.norm_eps),
                                   rtol=1e-5, atol=1e-5)


def test_qk_norm_makes_attention_invariant_to_query_and_key_scale() -> None:
    """What QK-norm is for: scaling wq or wk changes nothing (the norms undo it, up to their eps)."""
    model = build_model("tiny", seed=3)
    attn = model.layers["0"].attention
    x = torch.randn(1, 9, FLAVORS["tiny"].dim, generator=torch.Generator().manual_seed(1))
    cos, sin = model.rope_cos[:9], model.rope_sin[:9]
    with torch.no_grad():
        before = attn(x, cos, sin)
        attn.wq.weight.mul_(7.0)
        attn.wk.weight.mul_(0.5)
        torch.testing.assert_close(attn(x, cos, sin), before, rtol=1e-4, atol=1e-5)


def test_causal_and_shapes() -> None:
    model = build_model("tiny", seed=1)
    tokens = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 320
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 12, 320) and a.dtype == torch.float32
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_backward_reaches_every_parameter() -> None:
    model = build_model("tiny", seed=0)
    tokens = torch.randint(0, 320, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_init_is_a_function_of_seed_and_name() -> None:
    a, b, c = build_model("tiny", seed=5), build_model("tiny", seed=5), build_model("tiny", seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if pa.dim() > 1:
            assert not torch.equal(pa, pc), name
        else:
            assert torch.equal(pa, torch.ones_like(pa)), name  # norms (QK norms too) start at 1
