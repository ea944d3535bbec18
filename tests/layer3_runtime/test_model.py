"""The Llama-style model: sizes, shapes, causality, init determinism, GQA, RoPE,
RMSNorm and a local (single-process) simulation of tensor parallelism."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_spmd.models import get_model_spec
from torchtitan_spmd.models.common import (
    FeedForward,
    RMSNorm,
    ScaledDotProductAttention,
    count_parameters,
    precompute_rope,
)
from torchtitan_spmd.models.llama3 import (
    FLAVORS,
    Attention,
    LlamaConfig,
    Transformer,
    TransformerBlock,
    apply_rotary_emb,
    build_model,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def expected_param_count(c: LlamaConfig) -> int:
    """Hand formula: embeddings + output + final norm + n_layers blocks."""
    hidden = 4 * c.dim
    hidden = int(2 * hidden / 3)
    if c.ffn_dim_multiplier is not None:
        hidden = int(c.ffn_dim_multiplier * hidden)
    hidden = math.ceil(hidden / c.multiple_of) * c.multiple_of
    head_dim = c.dim // c.n_heads
    n_kv = c.n_heads if c.n_kv_heads is None else c.n_kv_heads
    attention = 2 * c.dim * c.dim + 2 * c.dim * n_kv * head_dim  # wq, wo + wk, wv
    ffn = 3 * c.dim * hidden
    block = attention + ffn + 2 * c.dim  # + two norms
    embeddings = (1 if c.enable_weight_tying else 2) * c.vocab_size * c.dim  # tied: one tensor
    return embeddings + c.n_layers * block + c.dim


def tokens_for(model: Transformer, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)


def named_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    wa, wb = named_weights(a), named_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


# --------------------------------------------------------------------------- sizes


def test_debugmodel_parameter_count() -> None:
    config = FLAVORS["debugmodel"]
    model = build_model("debugmodel", seed=0)
    n = count_parameters(model)
    assert 4_000_000 <= n <= 8_000_000
    assert n == expected_param_count(config)
    assert n == 6_065_408
    assert config.ffn_hidden_dim == 1024


#: The flavours small enough to build for real on CPU (upstream's 8B/70B/405B are meta-only here).
SMALL = sorted(f for f in FLAVORS if expected_param_count(FLAVORS[f]) < 50_000_000)


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_param_count_matches_formula(flavor: str) -> None:
    with torch.device("meta"):  # upstream's 405B has 405.9B parameters
        model = get_model_spec("llama3").build(FLAVORS[flavor])
    assert count_parameters(model) == expected_param_count(FLAVORS[flavor])


def test_tiny_flavor_shape() -> None:
    c = FLAVORS["tiny"]
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads) == (64, 2, 4, 2)
    assert count_parameters(build_model("tiny", seed=0)) < 200_000


def test_unknown_flavor_names_valid_ones() -> None:
    with pytest.raises(ValueError, match="nope") as info:
        build_model("nope", seed=0)
    for name in FLAVORS:
        assert name in str(info.value)


def test_vocab_size_override() -> None:
    model = build_model("tiny", seed=0, vocab_size=512)
    assert model.tok_embeddings.weight.shape == (512, 64)
    assert model.output.weight.shape == (512, 64)
    assert model(torch.tensor([[511, 3]])).shape == (1, 2, 512)


@pytest.mark.parametrize(
    "kwargs",
    [{"dim": 63}, {"n_kv_heads": 3}, {"n_heads": 0}, {"dim": 24, "n_heads": 8}, {"norm_eps": 0.0}],
)
def test_bad_config_raises(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        replace(FLAVORS["tiny"], **kwargs)


# ---------------------------------------------------------------- module tree


def test_module_names() -> None:
    model = build_model("tiny", seed=0)
    names = set(dict(model.named_parameters()))
    assert "tok_embeddings.weight" in names
    assert "norm.weight" in names
    assert "output.weight" in names
    for i in range(2):
        for suffix in (
            "attention_norm.weight",
            "attention.wq.weight",
            "attention.wk.weight",
            "attention.wv.weight",
            "attention.wo.weight",
            "ffn_norm.weight",
            "feed_forward.w1.weight",
            "feed_forward.w2.weight",
            "feed_forward.w3.weight",
        ):
            assert f"layers.{i}.{suffix}" in names
    assert len(names) == 3 + 2 * 9
    assert isinstance(model.layers, nn.ModuleDict)
    assert list(model.layers.keys()) == ["0", "1"]
    assert isinstance(model.layers["0"], TransformerBlock)
    assert isinstance(model.layers["0"].attention, Attention)
    assert isinstance(model.layers["0"].feed_forward, FeedForward)
    assert isinstance(model.norm, RMSNorm)
    sdpa = model.layers["0"].attention.sdpa
    assert isinstance(sdpa, ScaledDotProductAttention)
    assert list(sdpa.parameters()) == []
    for lin in (model.output, model.layers["1"].attention.wq, model.layers["1"].feed_forward.w2):
        assert lin.bias is None


def test_rope_buffers_non_persistent() -> None:
    model = build_model("tiny", seed=0)
    c = model.config
    assert model.rope_cos.shape == (c.max_seq_len, c.head_dim // 2)
    assert model.rope_sin.shape == (c.max_seq_len, c.head_dim // 2)
    assert model.rope_cos.dtype == torch.float32
    assert not model.rope_cos.is_complex()
    assert {"rope_cos", "rope_sin"} <= {n for n, _ in model.named_buffers()}
    assert not any(k.startswith("rope") for k in model.state_dict())


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("flavor", SMALL)
def test_forward_shape_and_dtype(flavor: str) -> None:
    model = build_model(flavor, seed=0)
    tokens = tokens_for(model, 2, 17)
    if model.config.attn_mask_type == "block_causal":  # packed documents: per-document positions
        from torchtitan_spmd.distributed.inputs import document_positions

        logits = model(tokens, positions=document_positions(tokens, 257))
    else:
        logits = model(tokens)
    assert logits.shape == (2, 17, model.config.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_forward_rejects_too_long_sequence() -> None:
    model = build_model("tiny", seed=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, model.config.max_seq_len + 1, dtype=torch.int64))


def test_backward_reaches_every_parameter() -> None:
    model = build_model("tiny", seed=0)
    tokens = tokens_for(model, 2, 8)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_causal() -> None:
    model = build_model("tiny", seed=1)
    tokens = tokens_for(model, 2, 12)
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_prefix_consistency() -> None:
    """Logits of a prefix do not depend on the total sequence length."""
    model = build_model("tiny", seed=2)
    tokens = tokens_for(model, 1, 20)
    with torch.no_grad():
        full, prefix = model(tokens), model(tokens[:, :9])
    torch.testing.assert_close(full[:, :9], prefix, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- init


def test_init_same_seed_bit_identical() -> None:
    assert_same_weights(build_model("tiny", seed=5), build_model("tiny", seed=5))


def test_init_different_seeds_differ() -> None:
    a, b = named_weights(build_model("tiny", seed=5)), named_weights(build_model("tiny", seed=6))
    for name in a:
        if a[name].dim() > 1:
            assert not torch.equal(a[name], b[name]), name


def test_init_parameters_independent_of_each_other() -> None:
    """No two matrices share their random stream."""
    weights = named_weights(build_model("tiny", seed=0))
    firsts = [w.flatten()[:8] for w in weights.values() if w.dim() > 1]
    for i in range(len(firsts)):
        for j in range(i):
            assert not torch.equal(firsts[i], firsts[j])


def test_init_reinit_restores_weights() -> None:
    model = build_model("tiny", seed=3)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        model.rope_cos.zero_()
    model.init_weights(3)
    assert_same_weights(model, reference)
    assert torch.equal(model.rope_cos, reference.rope_cos)
    assert torch.equal(model.rope_sin, reference.rope_sin)


def test_init_independent_of_construction_order() -> None:
    """Blocks built (and registered) in reverse order get the same weights by name."""
    reference = build_model("tiny", seed=9)
    config = FLAVORS["tiny"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)  # different default-init draws; init_weights overrides them
        model = Transformer(config)
        blocks = {str(i): TransformerBlock(i, config) for i in reversed(range(config.n_layers))}
    model.layers = nn.ModuleDict(blocks)  # keys now registered "1", "0"
    assert list(model.layers.keys()) == ["1", "0"]
    model.init_weights(9)
    assert_same_weights(model, reference)


def test_init_values() -> None:
    model = build_model("debugmodel", seed=0)
    n_layers = model.config.n_layers
    for name, p in model.named_parameters():
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        std = p.std().item()
        if name.endswith(("wo.weight", "w2.weight")):
            assert std == pytest.approx(0.02 / math.sqrt(2 * n_layers), rel=0.05), name
        else:
            assert std == pytest.approx(0.02, rel=0.05), name
        assert abs(p.mean().item()) < 0.003, name


def test_build_model_leaves_global_rng_alone() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_model("tiny", seed=0)
    assert torch.equal(torch.rand(3), expected)


# ---------------------------------------------------------------- components


def test_rmsnorm_hand_formula() -> None:
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    expected = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)
    # bf16 input: normalised in fp32, cast back, then scaled.
    xb = x.to(torch.bfloat16)
    expected_b = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(
        torch.bfloat16
    ) * norm.weight
    torch.testing.assert_close(norm(xb), expected_b)


def test_rope_matches_complex_rotation() -> None:
    head_dim, seq = 16, 10
    cos, sin = precompute_rope(head_dim, 32, 10000.0)
    x = torch.randn(2, seq, 3, head_dim, generator=torch.Generator().manual_seed(0))
    out = apply_rotary_emb(x, cos[:seq], sin[:seq])
    freqs = torch.polar(torch.ones(seq, head_dim // 2), torch.atan2(sin[:seq], cos[:seq]))
    xc = torch.view_as_complex(x.reshape(2, seq, 3, head_dim // 2, 2))
    expected = torch.view_as_real(xc * freqs.view(1, seq, 1, -1)).reshape_as(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # A rotation: norms are preserved and position 0 is the identity.
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(out[:, 0], x[:, 0])


def test_rope_scores_depend_on_relative_position() -> None:
    head_dim = 16
    cos, sin = precompute_rope(head_dim, 64, 10000.0)
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen)

    def score(pq: int, pk: int) -> torch.Tensor:
        qs = apply_rotary_emb(q.view(1, 1, 1, -1), cos[pq : pq + 1], sin[pq : pq + 1])
        ks = apply_rotary_emb(k.view(1, 1, 1, -1), cos[pk : pk + 1], sin[pk : pk + 1])
        return (qs * ks).sum()

    torch.testing.assert_close(score(5, 2), score(40, 37), rtol=1e-4, atol=1e-4)


def reference_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Plain per-head softmax attention with an explicit causal mask."""
    bs, seq, _ = x.shape
    hd = attn.head_dim
    q = apply_rotary_emb(attn.wq(x).view(bs, seq, attn.n_heads, hd), cos, sin)
    k = apply_rotary_emb(attn.wk(x).view(bs, seq, attn.n_kv_heads, hd), cos, sin)
    v = attn.wv(x).view(bs, seq, attn.n_kv_heads, hd)
    n_rep = attn.n_heads // attn.n_kv_heads
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    heads = []
    for h in range(attn.n_heads):
        kv = h // n_rep
        scores = q[:, :, h] @ k[:, :, kv].transpose(1, 2) / math.sqrt(hd)
        scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, :, kv])
    return attn.wo(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (8, 2), (4, 1), (8, None)])
def test_gqa_matches_reference(n_heads: int, n_kv_heads: int | None) -> None:
    config = replace(FLAVORS["tiny"], n_heads=n_heads, n_kv_heads=n_kv_heads)
    model = Transformer(config)
    model.init_weights(0)
    attn = model.layers["0"].attention
    expected_kv = n_heads if n_kv_heads is None else n_kv_heads
    assert attn.wk.weight.shape == (expected_kv * config.head_dim, config.dim)
    x = torch.randn(2, 11, config.dim, generator=torch.Generator().manual_seed(0))
    cos, sin = model.rope_cos[:11], model.rope_sin[:11]
    with torch.no_grad():
        torch.testing.assert_close(
            attn(x, cos, sin), reference_attention(attn, x, cos, sin), rtol=1e-5, atol=1e-5
        )
        assert model(tokens_for(model, 2, 11)).shape == (2, 11, config.vocab_size)


# ------------------------------------------------------- local TP simulation


def _local_shard(
    module: nn.Module, colwise: tuple[str, ...], rowwise: tuple[str, ...], tp: int, rank: int
):
    """A copy of ``module`` holding only rank ``rank``'s slice of each weight."""
    local = copy.deepcopy(module)
    for name in colwise:
        lin = getattr(local, name)
        lin.weight = nn.Parameter(lin.weight.detach().chunk(tp, dim=0)[rank].clone())
    for name in rowwise:
        lin = getattr(local, name)
        lin.weight = nn.Parameter(lin.weight.detach().chunk(tp, dim=1)[rank].clone())
    return local


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,tp", [(4, 2, 2), (4, 4, 2), (8, 4, 4), (8, 2, 2), (4, 4, 4)]
)
def test_local_tensor_parallel_block_matches_full(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """Column-shard wq/wk/wv/w1/w3, row-shard wo/w2, run every rank's local
    modules on local weights and sum the partial outputs: equals the full block.
    This is what a TP rank does, and it needs the ``-1`` head-count inference."""
    config = replace(FLAVORS["tiny"], n_heads=n_heads, n_kv_heads=n_kv_heads)
    model = Transformer(config)
    model.init_weights(4)
    block = model.layers["0"]
    seq = 13
    x = torch.randn(2, seq, config.dim, generator=torch.Generator().manual_seed(3))
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
    attns = [_local_shard(block.attention, ("wq", "wk", "wv"), ("wo",), tp, r) for r in range(tp)]
    ffns = [_local_shard(block.feed_forward, ("w1", "w3"), ("w2",), tp, r) for r in range(tp)]
    assert attns[0].wq.weight.shape[0] == config.dim // tp
    with torch.no_grad():
        xn = block.attention_norm(x)
        h = x + sum(a(xn, cos, sin) for a in attns)
        hn = block.ffn_norm(h)
        out = h + sum(f(hn) for f in ffns)
        expected = block(x, cos, sin)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
