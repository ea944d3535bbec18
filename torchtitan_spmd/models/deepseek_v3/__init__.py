"""The ``deepseek_v3`` family: a DeepSeek-V3-style decoder (MLA, DeepSeek's MoE), its plan, flavours and validation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchtitan_spmd.models import ModelSpec
from torchtitan_spmd.models.common import check_attn_mask_type, check_seq_len, check_tp_divisible
from torchtitan_spmd.models.rope import RopeScaling

from .model import (
    DeepSeekV3Block,
    DeepSeekV3Config,
    DeepSeekV3Model,
    LatentAttention,
    yarn_softmax_scale,
)
from .plan import deepseek_v3_plan
from .state_dict_adapter import DeepSeekV3StateDictAdapter

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims

__all__ = [
    "FLAVORS",
    "MODEL_SPEC",
    "model_registry",
    "DeepSeekV3Block",
    "DeepSeekV3Config",
    "DeepSeekV3Model",
    "DeepSeekV3StateDictAdapter",
    "LatentAttention",
    "build_model",
    "deepseek_v3_plan",
    "validate",
    "yarn_softmax_scale",
]

def _yarn(mscale: float) -> dict[str, Any]:
    return dict(rope_theta=10000.0, rope_scaling=RopeScaling(
        kind="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
        mscale=mscale, mscale_all_dim=mscale))

#: Upstream's flavours (a0c831c49's sizes; the vocabulary is the tokenizer's, set by the trainer),
#: plus ``tiny`` for tests: 3 layers (1 dense, 2 MoE), q_lora_rank 16, query/key heads 24 wide and
#: value heads 16 (as the real ones, 192 and 128: different), YaRN with factor 4, 8 experts in 4
#: groups (top-2 of 2 groups), sigmoid scores normalised and scaled by 2.5, one shared expert.
FLAVORS: dict[str, DeepSeekV3Config] = {
    "debugmodel": DeepSeekV3Config(
        dim=256, n_layers=6, n_heads=16, vocab_size=2048, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, hidden_dim=1024, first_k_dense_replace=1, num_experts=8,
        top_k=3, moe_hidden_dim=256, n_shared_experts=2, score_func="softmax", max_seq_len=4096 * 4, **_yarn(0.7),
    ),
    "16B": DeepSeekV3Config(
        dim=2048, n_layers=27, n_heads=16, vocab_size=102400, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, hidden_dim=10944, first_k_dense_replace=1,
        num_experts=64, top_k=6, moe_hidden_dim=1408, n_shared_experts=2, score_func="softmax",
        max_seq_len=4096 * 4, **_yarn(0.7),
    ),
    "671B": DeepSeekV3Config(
        dim=7168, n_layers=61, n_heads=128, vocab_size=129280, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, hidden_dim=18432,
        first_k_dense_replace=3, num_experts=256, top_k=8, moe_hidden_dim=2048, n_shared_experts=1,
        score_func="sigmoid", n_group=8, topk_group=4, route_scale=2.5, route_norm=True, max_seq_len=4096 * 4,
        **_yarn(1.0),
    ),
    "tiny": DeepSeekV3Config(
        dim=64, n_layers=3, n_heads=4, vocab_size=320, q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0,
        rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0), hidden_dim=128, first_k_dense_replace=1,
        num_experts=8, top_k=2, moe_hidden_dim=32, n_shared_experts=1, score_func="sigmoid", n_group=4,
        topk_group=2, route_norm=True, route_scale=2.5, max_seq_len=512,
    ),
}


def validate(config: DeepSeekV3Config, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """Raise ValueError when ``training.seq_len`` does not fit or tensor parallelism cannot shard ``config``
    evenly (heads, the dense and expert widths, the shared experts' width, the vocabulary)."""
    check_seq_len(config.max_seq_len, job_config)
    check_attn_mask_type(config, job_config, parallel_dims)
    sizes = {"model n_heads": config.n_heads, "model hidden_dim": config.hidden_dim,
             "vocab size": config.vocab_size}
    if config.moe_enabled:
        sizes["model moe_hidden_dim"] = config.moe_hidden_dim
    check_tp_divisible(sizes, job_config, parallel_dims)


MODEL_SPEC = ModelSpec(
    name="deepseek_v3",
    flavors=FLAVORS,
    build=DeepSeekV3Model,
    sharding_plan=deepseek_v3_plan,
    validate=validate,
    state_dict_adapter=DeepSeekV3StateDictAdapter,
)


#: ``build_model(flavor, *, seed, vocab_size=None)``: full-size on CPU, initialised (tests, notebooks).
build_model = MODEL_SPEC.build_initialized


def model_registry(flavor: str, attn_backend: str | None = None, converters: list[Any] | None = None) -> ModelSpec:
    """Upstream's ``model_registry(flavor, attn_backend=..., converters=[...])``: the family's spec with
    ``flavor`` and the model converters (``job.model_spec = model_registry(...)``). ``attn_backend`` is
    accepted for upstream's recipes and ignored: this library's attention is SDPA (with a mask for
    packed documents), on every device."""
    del attn_backend
    return MODEL_SPEC.registry(flavor, converters)
