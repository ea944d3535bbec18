"""Helpers for the Hugging Face weights tests: transformers itself is the reference.

A random tiny ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` of the ``tiny`` flavours' sizes
(configs written out here from transformers' own field names, not from the library's
adapter), every weight perturbed (norms included, so a norm taken from another layer shows),
saved by ``save_pretrained`` in bfloat16 (qwen3 sharded over several files with
``model.safetensors.index.json``). The real Trainer on forked gloo ranks loads it
(``checkpoint.initial_load_in_hf``), exports it once before any step and once after
training (``checkpoint.last_save_in_hf``, ``export_dtype=bfloat16``), and reports its
step-1 batch and loss and its trained weights; the tests compare those with transformers.

One forked launch per (backend, layout) runs both families, one after the other.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from parity_helpers import warm_parent

from torchtitan_spmd.checkpoint.manager import find_checkpoints
from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

FAMILIES = ("llama3", "qwen3")
#: name -> (world size, parallelism); FSDP 2 x TP 2 and one process.
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "fsdp2_tp2": (4, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}),
    "single": (1, {"data_parallel_shard_degree": 1}),
}
STEPS = 2
SEQ_LEN = 32
GLOBAL_BATCH = 4
#: The step number of the export written right after loading, before any training step.
NO_STEP_EXPORT = 100
EXPORT_DTYPE = "bfloat16"
TOL = 1e-5


def hf_model(family: str, seed: int = 0) -> Any:
    """A random transformers model of family ``family``'s ``tiny`` sizes, every weight perturbed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  max_position_embeddings=512)
    torch.manual_seed(seed)
    if family == "llama3":
        model = LlamaForCausalLM(LlamaConfig(**common, rms_norm_eps=1e-5,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, rms_norm_eps=1e-6,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms: ones -> 1 +- 0.3, different in every layer
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


def save_source(family: str, folder: Path) -> Path:
    """``save_pretrained`` of :func:`hf_model` in bfloat16; qwen3 sharded over several files."""
    import torch

    model = hf_model(family).to(torch.bfloat16)
    model.save_pretrained(str(folder), max_shard_size="120KB" if family == "qwen3" else "50GB")
    return folder


def hf_job(family: str, flavor: str, parallelism: dict[str, Any], local_batch: int, src: Path,
           dump: Path) -> JobConfig:
    """The job of every HF round-trip test: ``STEPS`` steps at ``SEQ_LEN``, fp32, no AC, loading
    ``src`` as Hugging Face safetensors and exporting in ``EXPORT_DTYPE`` (``parallelism`` holds
    the degrees and ``spmd_backend``)."""
    return JobConfig.from_dict({
        "model": {"name": family, "flavor": flavor},
        "training": {"steps": STEPS, "local_batch_size": local_batch, "seq_len": SEQ_LEN, "device": "cpu",
                     "max_norm": 1.0, "mixed_precision_param": "float32"},
        "activation_checkpoint": {"mode": "none"},
        "optimizer": {"lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 1},
        "parallelism": parallelism,
        "debug": {"seed": 7, "deterministic": True},
        "job": {"dump_folder": str(dump)},
        "checkpoint": {"enable": True, "interval": 1000, "initial_load_path": str(src),
                       "initial_load_in_hf": True, "last_save_in_hf": True, "export_dtype": EXPORT_DTYPE},
    })


def hf_config(family: str, layout: str, backend: str, src: Path, dump: Path, *, flavor: str = "tiny") -> JobConfig:
    world, par = LAYOUTS[layout]
    local = GLOBAL_BATCH * par.get("tensor_parallel_degree", 1) // world
    return hf_job(family, flavor, {**par, "spmd_backend": backend}, local, src, dump)


class _Recording:
    """The trainer's data loader, keeping the first batch it hands out."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.first = inner, None

    def __iter__(self) -> _Recording:
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        if self.first is None:
            self.first = (batch[0].tolist(), batch[1].tolist())
        return batch


def _worker(rank: int, world: int, configs: list[JobConfig]) -> list[dict[str, Any]]:
    from torch.distributed.tensor import DTensor

    from torchtitan_spmd.techniques.fsdp import clear_dtensor_sharding_caches
    from torchtitan_spmd.train import Trainer

    out = []
    for cfg in configs:
        # A second trainer in the process: DTensor's propagation caches key on mesh equality
        # and would hand the first trainer's (equal) mesh objects to the second.
        clear_dtensor_sharding_caches()
        trainer = Trainer(cfg)
        try:
            assert trainer.checkpointer.loaded is not None and trainer.start_step == 0
            trainer.checkpointer.save(NO_STEP_EXPORT, last_step=True)  # load -> export, no step
            trainer.dataloader = _Recording(trainer.dataloader)  # type: ignore[assignment]
            records = trainer.run()
            state = trainer.checkpointer._model_state()  # global-shape views, every backend
            full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).tolist() for k, v in state.items()}
            batch_mesh = trainer.parallel_dims.get_optional_mesh("batch")
            out.append({
                "loss1": records[0].loss,
                "steps": [r.step for r in records],
                "dp_rank": batch_mesh.get_local_rank() if batch_mesh is not None else 0,
                "batch": trainer.dataloader.first,
                "weights": full if rank == 0 or _holds_a_stage_of_rank_0(trainer) else None,
            })
        finally:
            trainer.close()
    return out


def _holds_a_stage_of_rank_0(trainer: Any) -> bool:
    """Under pipeline parallelism: whether this rank is in rank 0's ``pp`` group (one rank per
    stage, together the whole model: the parent merges their weights)."""
    import torch.distributed as dist

    return trainer.pipeline is not None and 0 in dist.get_process_group_ranks(trainer.pipeline.group)


def merged_weights(per_rank: list[list[dict[str, Any]]], i: int) -> dict[str, Any]:
    """The whole model's weights of launch item ``i``: rank 0's, with the other stages' under PP."""
    out: dict[str, Any] = {}
    for rank_results in per_rank:
        out.update(rank_results[i]["weights"] or {})
    return out


def run_both_families(backend: str, layout: str, root: Path, sources: dict[str, Path], *,
                      flavor: str = "tiny") -> dict[str, dict[str, Any]]:
    """Train each family from its source folder under ``backend``/``layout`` (one launch);
    family -> {"loss1", "batch" (tokens, labels of the global step-1 batch), "weights", "dump"}."""
    warm_parent()
    import torch.distributed.checkpoint  # noqa: F401  (import once, before forking)

    world, _ = LAYOUTS[layout]
    dumps = {f: root / f"{backend}-{layout}-{f}" for f in FAMILIES}
    configs = [hf_config(f, layout, backend, sources[f], dumps[f], flavor=flavor) for f in FAMILIES]
    per_rank = run_forked(_worker, world, configs, timeout_s=300)
    results = {}
    for i, family in enumerate(FAMILIES):
        rows: dict[int, Any] = {}
        for rank_results in per_rank:
            r = rank_results[i]
            assert r["loss1"] == per_rank[0][i]["loss1"] and r["steps"] == list(range(1, STEPS + 1))
            rows.setdefault(r["dp_rank"], r["batch"])
        tokens = [row for dp in sorted(rows) for row in rows[dp][0]]
        labels = [row for dp in sorted(rows) for row in rows[dp][1]]
        results[family] = {"loss1": per_rank[0][i]["loss1"], "tokens": tokens, "labels": labels,
                           "weights": per_rank[0][i]["weights"], "dump": dumps[family]}
    return results


# ------------------------------------------------------------------ what the tests compare
def read_safetensors(folder: Path) -> dict[str, Any]:
    """Every tensor of every ``*.safetensors`` file in ``folder``."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(str(folder / name)))
    return out


def hf_cross_entropy(folder: Path, tokens: list[list[int]], labels: list[list[int]]) -> float:
    """transformers' own mean next-token cross-entropy of the model in ``folder`` on the batch (fp32)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(tokens)).logits
    return F.cross_entropy(logits.flatten(0, 1).double(), torch.tensor(labels).flatten(), ignore_index=-100).item()


def export_logits_gap(export: Path, family: str, weights: dict[str, list], tokens: list[list[int]]) -> float:
    """Largest |logit| difference between ``from_pretrained(export)`` and this library's model with the
    trainer's final weights (rounded to the export dtype) on ``tokens``."""
    import torch
    from transformers import AutoModelForCausalLM

    from torchtitan_spmd.models import get_model_spec

    hf = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    ours = get_model_spec(family).build_initialized("tiny", seed=0)
    dtype = getattr(torch, EXPORT_DTYPE)
    ours.load_state_dict({k: torch.tensor(v).to(dtype).float() for k, v in weights.items()})
    x = torch.tensor(tokens)
    with torch.no_grad():
        return (hf(x).logits - ours(x)).abs().max().item()


def exported_dtypes(folder: Path) -> tuple[set[str], str]:
    """The dtypes of the tensors in ``folder``'s safetensors files, and config.json's ``dtype``."""
    tensors = read_safetensors(folder)
    config = json.loads((folder / "config.json").read_text())
    return {str(t.dtype).removeprefix("torch.") for t in tensors.values()}, config.get("dtype")


def check_round_trip(backend: str, layout: str, root: Path, sources: dict[str, Path]) -> dict[str, dict[str, float]]:
    """Run both families under ``backend``/``layout`` and assert, for each, against transformers:

    1. the step-1 loss is transformers' own cross-entropy of the source model on the same
       global batch, within ``TOL``;
    2. the export written right after loading (no step) holds exactly the source's tensors
       (names, dtypes, bits); neither export is taken for a checkpoint to resume from;
    3. the export after training is in ``EXPORT_DTYPE`` (files and config.json), opens with
       ``AutoModelForCausalLM.from_pretrained``, and its logits equal this library's model
       with the trainer's final weights within ``TOL``.

    The single-process layout builds the model with ``--model.flavor from_hf``. Returns the
    measured gaps per family.
    """
    flavor = "from_hf" if layout == "single" else "tiny"
    results = run_both_families(backend, layout, root, sources, flavor=flavor)
    gaps = {}
    for family, r in results.items():
        want = hf_cross_entropy(sources[family], r["tokens"], r["labels"])
        loss_gap = abs(r["loss1"] - want)
        assert loss_gap < TOL, f"{family}: step-1 loss {r['loss1']!r}, transformers' {want!r}"

        ck = r["dump"] / "checkpoint"
        source, exported = read_safetensors(sources[family]), read_safetensors(ck / f"step-{NO_STEP_EXPORT}")
        assert sorted(exported) == sorted(source), f"{family}: {sorted(set(exported) ^ set(source))}"
        for key, tensor in source.items():
            assert exported[key].dtype == tensor.dtype and exported[key].equal(tensor), f"{family}: {key} differs"

        # both exports carry the completion marker and are neither resumable nor "incomplete"
        assert find_checkpoints(str(ck)) == ({}, []), (family, find_checkpoints(str(ck)))
        final = ck / f"step-{STEPS}"
        dtypes, config_dtype = exported_dtypes(final)
        assert dtypes == {EXPORT_DTYPE} and config_dtype == EXPORT_DTYPE, (family, dtypes, config_dtype)
        assert (final / "model.safetensors.index.json").is_file()
        logits_gap = export_logits_gap(final, family, r["weights"], r["tokens"])
        assert logits_gap < TOL, f"{family}: exported logits differ by {logits_gap}"
        gaps[family] = {"loss": loss_gap, "logits": logits_gap}
    return gaps
