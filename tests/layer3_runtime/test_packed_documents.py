"""Packed documents (``attn_mask_type="block_causal"``): each document attends only within itself.

- the inputs: per-document positions (restarting after each EOS) and the boundary label ignored,
  checked on hand-written windows;
- the model: in a packed window, each document's logits equal those of the document alone
  (a causal model on just its tokens), for every family;
- the trainer against the independent reference (which restates the mask, the positions and the
  boundary rule itself) on windows of two to four documents: loss, gradient norm and every
  parameter's gradient norm at step 1, real gloo ranks, FSDP 2 x TP 2 and PP 2 x FSDP 2;
- bad input: an unknown ``attn_mask_type``, block-causal under CP, a forward without positions.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from packed_helpers import LOCAL_BATCH, check_packed_parity, packed_config, run_config
from parity_helpers import max_rel, skip_full_dtensor_on_old_torch

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.distributed.inputs import document_positions
from torchtitan_spmd.distributed.parallel_dims import ParallelDims
from torchtitan_spmd.models import get_model_spec
from torchtitan_spmd.techniques.loss import IGNORE_INDEX, mask_document_boundaries

EOS = 257


# ----------------------------------------------------------------------------- inputs
def test_document_positions_restart_after_each_eos() -> None:
    tokens = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, 1],
                           [EOS, 1, 2, 3, EOS, EOS, 4, 5]])
    want = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0],
                         [0, 0, 1, 2, 3, 0, 0, 1]])
    assert torch.equal(document_positions(tokens, EOS), want)


def test_the_label_after_each_eos_is_ignored() -> None:
    tokens = torch.tensor([[5, 6, EOS, 7, 8, EOS]])
    labels = torch.tensor([[6, EOS, 7, 8, EOS, 9]])
    want = torch.tensor([[6, EOS, IGNORE_INDEX, 8, EOS, IGNORE_INDEX]])
    assert torch.equal(mask_document_boundaries(labels, tokens, EOS), want)


# ----------------------------------------------------------------------------- the model
def _family_configs(family: str) -> tuple[object, object]:
    spec = get_model_spec(family)
    causal = spec.model_config("tiny")
    return causal, replace(causal, attn_mask_type="block_causal")


@pytest.mark.parametrize("family", ["llama3", "qwen3", "deepseek_v3"])
def test_each_document_attends_only_within_itself(family: str) -> None:
    """Every document's logits in a packed window are the logits of that document alone."""
    spec = get_model_spec(family)
    causal_cfg, packed_cfg = _family_configs(family)
    torch.manual_seed(0)
    causal, packed = spec.build(causal_cfg), spec.build(packed_cfg)
    causal.init_weights(3)
    packed.load_state_dict(causal.state_dict())
    docs = [[256, 10, 11, 12, EOS], [256, 20, 21, 22, 23, 24, EOS], [256, 30, 31]]
    tokens = torch.tensor([sum(docs, [])])
    with torch.no_grad():
        out = packed(tokens, positions=document_positions(tokens, EOS))
        start = 0
        for doc in docs:
            alone = causal(torch.tensor([doc]))
            got = out[:, start:start + len(doc)]
            assert torch.allclose(got, alone, atol=1e-5), (family, start, (got - alone).abs().max())
            start += len(doc)
        # the check means something: without the mask the later documents' logits change
        assert not torch.allclose(causal(tokens)[:, 5:], out[:, 5:], atol=1e-3)


def test_block_causal_forward_needs_positions() -> None:
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        model = spec.build(spec.model_config("tiny_block_causal"))
    with pytest.raises(ValueError, match="block_causal.*document_positions"):
        model(torch.zeros(1, 4, dtype=torch.long, device="meta"))


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("family,owner", [("llama3", "LlamaConfig"), ("qwen3", "Qwen3Config"),
                                          ("deepseek_v3", "DeepSeekV3Config")])
def test_unknown_attn_mask_type_names_the_field(family: str, owner: str) -> None:
    with pytest.raises(ValueError, match=f"{owner}.attn_mask_type must be one of 'causal', 'block_causal', "
                                         "got 'document'"):
        replace(get_model_spec(family).flavors["tiny"], attn_mask_type="document")


def test_block_causal_under_context_parallelism_is_a_setup_error() -> None:
    spec = get_model_spec("llama3")
    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=2, tp=1, pp=1, ep=1, world_size=2,
                      spmd_backend="default", device_type="cpu")
    job = JobConfig.from_dict({"model": {"flavor": "tiny_block_causal"}, "training": {"seq_len": 32}})
    with pytest.raises(ValueError, match="context parallelism cannot run.*ring attention takes no mask.*"
                                         "without CP"):
        spec.validate(spec.flavors["tiny_block_causal"], job, pd)
    spec.validate(spec.flavors["tiny"], job, pd)  # causal runs under CP


# ----------------------------------------------------------------------------- the trainer
def test_the_reference_sees_the_documents() -> None:
    """The reference's block-causal gradient differs from its causal one on the same batch (step 1;
    its loss, at the initial weights, differs by only 3e-4)."""
    from torchtitan_spmd.reference import run_reference

    par = {"data_parallel_shard_degree": 1}
    packed = run_reference(packed_config("default", par, local_batch=4, steps=1), global_batch=4)
    causal = run_reference(packed_config("default", par, flavor="tiny", local_batch=4, steps=1), global_batch=4)
    assert max_rel([p[1] for p in packed], [c[1] for c in causal]) > 1e-2, (packed, causal)  # the gradient norms


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_block_causal_parity_fsdp2_tp2(backend: str) -> None:
    skip_full_dtensor_on_old_torch(backend, "fsdp2_tp2")
    cfg = packed_config(backend, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2})
    got = run_config(cfg, 4)
    loss, norm = check_packed_parity(got, LOCAL_BATCH * 2, f"block_causal {backend} fsdp2_tp2")
    print(f"\nblock_causal {backend} fsdp2_tp2: max rel diff loss {loss:.1e} grad_norm {norm:.1e}")


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_block_causal_parity_pp2_fsdp2(backend: str) -> None:
    """Under PP every stage gets the positions (a schedule keyword, split as the tokens): the later
    stage's attention masks by document too."""
    skip_full_dtensor_on_old_torch(backend, "fsdp4")  # data parallelism under full_dtensor
    cfg = packed_config(backend, {"data_parallel_shard_degree": 2, "pipeline_parallel_degree": 2,
                                  "pipeline_parallel_microbatch_size": 1, "pipeline_parallel_schedule": "1F1B"})
    cfg.training.global_batch_size = LOCAL_BATCH * 2
    got = run_config(cfg, 4)
    loss, norm = check_packed_parity(got, LOCAL_BATCH * 2, f"block_causal {backend} pp2_fsdp2")
    print(f"\nblock_causal {backend} pp2_fsdp2: max rel diff loss {loss:.1e} grad_norm {norm:.1e}")


def test_block_causal_needs_a_tokenizer_with_an_eos_id() -> None:
    from types import SimpleNamespace

    from torchtitan_spmd.train import packed_documents_eos

    spec = get_model_spec("llama3")
    job = JobConfig.from_dict({"model": {"flavor": "tiny_block_causal"}})
    assert packed_documents_eos(spec.flavors["tiny_block_causal"], SimpleNamespace(eos_id=7), job) == 7
    assert packed_documents_eos(spec.flavors["tiny"], SimpleNamespace(eos_id=None), job) is None
    with pytest.raises(ValueError, match="attn_mask_type='block_causal'.*has no eos_id"):
        packed_documents_eos(spec.flavors["tiny_block_causal"], SimpleNamespace(eos_id=None), job)
