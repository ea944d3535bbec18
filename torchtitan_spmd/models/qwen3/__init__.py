"""The ``qwen3`` family: a Qwen3-style decoder (QK RMSNorm per head), its plan, flavours and validation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan_spmd.models import ModelSpec
from torchtitan_spmd.models.common import check_seq_len, check_tp_divisible

from .model import Qwen3Attention, Qwen3Block, Qwen3Config, Qwen3Model, apply_rotary_emb_half
from .plan import qwen3_plan
from .state_dict_adapter import Qwen3StateDictAdapter

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims

__all__ = [
    "Qwen3StateDictAdapter",
    "FLAVORS",
    "MODEL_SPEC",
    "Qwen3Attention",
    "Qwen3Block",
    "Qwen3Config",
    "Qwen3Model",
    "apply_rotary_emb_half",
    "build_model",
    "qwen3_plan",
    "validate",
]

#: Named model sizes; the vocabulary matches :class:`torchtitan_spmd.data.Tokenizer`
#: (320 ids). ``debugmodel`` (6.07M parameters) has heads twice as wide as
#: ``dim / n_heads``; ``tiny`` is for fast tests.
FLAVORS: dict[str, Qwen3Config] = {
    "debugmodel": Qwen3Config(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768, vocab_size=320,
        norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=2048,
    ),
    "tiny": Qwen3Config(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=192, vocab_size=320,
        norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=512,
    ),
}


def validate(config: Qwen3Config, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """Raise ValueError when ``training.seq_len`` does not fit or tensor parallelism cannot shard ``config`` evenly."""
    check_seq_len(config.max_seq_len, job_config)
    check_tp_divisible({
        "model n_heads": config.n_heads,
        "model n_kv_heads": config.n_kv_heads,
        "model hidden_dim": config.hidden_dim,
        "vocab size": config.vocab_size,
    }, job_config, parallel_dims)


MODEL_SPEC = ModelSpec(
    name="qwen3",
    flavors=FLAVORS,
    build=Qwen3Model,
    sharding_plan=qwen3_plan,
    validate=validate,
    state_dict_adapter=Qwen3StateDictAdapter,
)


#: ``build_model(flavor, *, seed, vocab_size=None)``: full-size on CPU, initialised (tests, notebooks).
build_model = MODEL_SPEC.build_initialized
