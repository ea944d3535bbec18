"""Helpers for the real-checkpoint-shape tests: RoPE scaling and tied embeddings against transformers.

Three tiny random transformers models, of the shapes users load first (written out here from
transformers' own field names; none from this library's adapter):

- ``llama31``: Llama 3.1-shaped, ``rope_type="llama3"`` scaling whose original context (16) is
  shorter than the training sequence (32), so the scaling changes the loss;
- ``llama32_tied``: Llama 3.2-shaped, the same scaling, ``tie_word_embeddings=True``;
- ``qwen3_tied``: Qwen3-0.6B-shaped (head_dim wider than hidden / heads, QK norms),
  ``tie_word_embeddings=True``.

Each is saved with ``save_pretrained`` (float32) and trained by the real Trainer on forked gloo
ranks through ``hf_helpers._worker`` (``--model.flavor from_hf``, HF load, an export before
any step and one after training).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hf_helpers import NO_STEP_EXPORT, _worker, hf_cross_entropy, merged_weights, read_safetensors
from parity_helpers import warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

MODELS = ("llama31", "llama32_tied", "qwen3_tied")
FAMILY = {"llama31": "llama3", "llama32_tied": "llama3", "qwen3_tied": "qwen3"}
#: name -> (world size, parallelism).
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "fsdp2_tp2": (4, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}),
    "pp2_fsdp2": (4, {"data_parallel_shard_degree": 2, "pipeline_parallel_degree": 2,
                      "pipeline_parallel_schedule": "1F1B", "pipeline_parallel_microbatch_size": 1}),
    "single": (1, {"data_parallel_shard_degree": 1}),
}
STEPS = 2
SEQ_LEN = 32
GLOBAL_BATCH = 4
TOL = 1e-5
LLAMA_SCALING = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def hf_model(name: str, seed: int = 0, *, rope_parameters: dict[str, Any] | None = None) -> Any:
    """A random transformers model ``name``, every weight perturbed (norms too)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    if name == "qwen3_tied":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                             rope_parameters=rope_parameters or {"rope_type": "default",
                                                                                 "rope_theta": 1e6}))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=name.endswith("_tied"),
                                             rope_parameters=rope_parameters or dict(LLAMA_SCALING)))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
    return model.eval()


def save_source(name: str, folder: Path) -> Path:
    """``save_pretrained`` of :func:`hf_model` (float32)."""
    hf_model(name).save_pretrained(str(folder))
    return folder


def job(name: str, layout: str, backend: str, src: Path, dump: Path) -> JobConfig:
    """The trainer job that loads ``src`` (``from_hf``) and exports before and after training."""
    world, par = LAYOUTS[layout]
    dp = par.get("data_parallel_shard_degree", 1)
    return JobConfig.from_dict({
        "model": {"name": FAMILY[name], "flavor": "from_hf"},
        "training": {"steps": STEPS, "local_batch_size": GLOBAL_BATCH // dp, "seq_len": SEQ_LEN, "device": "cpu",
                     "max_norm": 1.0, "mixed_precision_param": "float32"},
        "activation_checkpoint": {"mode": "none"},
        "optimizer": {"lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 1},
        "parallelism": {**par, "spmd_backend": backend},
        "debug": {"seed": 7, "deterministic": True},
        "job": {"dump_folder": str(dump)},
        "checkpoint": {"enable": True, "interval": 1000, "initial_load_path": str(src),
                       "initial_load_in_hf": True, "last_save_in_hf": True, "export_dtype": "float32"},
    })


def _worker_recording_reads(rank: int, world: int, configs: list[JobConfig]) -> list[dict[str, Any]]:
    """``hf_helpers._worker``, also recording the Hugging Face tensors this rank's DCP read
    asked for (``hf_reads``: the names in its read plan; one load per config, in order)."""
    from torchtitan_spmd.checkpoint.hf import safe_reader_class

    reader = safe_reader_class()  # DCP's HuggingFaceStorageReader, every file through open_inside
    reads: list[list[str]] = []
    original = reader.read_data

    def read_data(self: Any, plan: Any, planner: Any) -> Any:
        reads.append(sorted({item.storage_index.fqn for item in plan.items}))
        return original(self, plan, planner)

    reader.read_data = read_data  # this forked rank's copy only
    try:
        out = _worker(rank, world, configs)
    finally:
        reader.read_data = original
    assert len(reads) == len(out), f"rank {rank}: {len(reads)} Hugging Face reads for {len(out)} jobs"
    for result, names in zip(out, reads, strict=True):
        result["hf_reads"] = names
    return out


def check_stage_reads(reads: list[list[str]], source: list[str], pp: int) -> None:
    """Under PP (``pp`` outermost: ranks ``s * world / pp ...`` hold stage ``s``): every rank of a
    stage reads the same tensors, no two stages read the same one, together they read the whole
    folder, the first stage the embedding and the last the norm and ``lm_head``."""
    per_stage = len(reads) // pp
    stages = [set(reads[s * per_stage]) for s in range(pp)]
    for rank, names in enumerate(reads):
        assert set(names) == stages[rank // per_stage], f"rank {rank} read {names}, its stage {stages[rank // per_stage]}"
    for a in range(pp):
        for b in range(a + 1, pp):
            assert not stages[a] & stages[b], f"stages {a} and {b} both read {sorted(stages[a] & stages[b])}"
    assert sorted(set().union(*stages)) == sorted(source), sorted(set(source) ^ set().union(*stages))
    assert "model.embed_tokens.weight" in stages[0], sorted(stages[0])
    assert {"model.norm.weight", "lm_head.weight"} <= stages[-1], sorted(stages[-1])


def names_written(folder: Path) -> list[str]:
    """Every tensor name of every ``*.safetensors`` file in ``folder``, repeats kept."""
    from safetensors import safe_open

    out: list[str] = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.extend(f.keys())
    return out


def run(backend: str, layout: str, root: Path, sources: dict[str, Path],
        names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Train each of ``names`` under ``backend``/``layout`` (one launch): name -> loss1, batch, weights, dump."""
    warm_parent()
    import torch.distributed.checkpoint  # noqa: F401  (import once, before forking)

    world, _ = LAYOUTS[layout]
    dumps = {n: root / f"{backend}-{layout}-{n}" for n in names}
    per_rank = run_forked(_worker_recording_reads, world,
                          [job(n, layout, backend, sources[n], dumps[n]) for n in names], timeout_s=300)
    out = {}
    for i, name in enumerate(names):
        rows: dict[int, Any] = {}
        for rank_results in per_rank:
            r = rank_results[i]
            rows.setdefault(r["dp_rank"], r["batch"])
        out[name] = {"loss1": per_rank[0][i]["loss1"], "weights": merged_weights(per_rank, i), "dump": dumps[name],
                     "tokens": [row for dp in sorted(rows) for row in rows[dp][0]],
                     "labels": [row for dp in sorted(rows) for row in rows[dp][1]],
                     "hf_reads": [rank_results[i]["hf_reads"] for rank_results in per_rank]}
    return out


def check(backend: str, layout: str, root: Path, sources: dict[str, Path],
          names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Assert, for each model: step-1 loss = transformers' cross-entropy (``TOL`` relative); the
    export before any step holds the source's tensors bit for bit (a tied one: no ``lm_head``,
    ``tie_word_embeddings`` true); the trained export opens with ``from_pretrained`` and gives
    this library's logits with the trainer's weights; under PP each stage read only its own
    tensors (:func:`check_stage_reads`) and the export holds the whole model once. Returns the gaps."""
    import torch
    from transformers import AutoModelForCausalLM

    from torchtitan_spmd.models import get_model_spec

    results = run(backend, layout, root, sources, names)
    gaps = {}
    for name, r in results.items():
        want = hf_cross_entropy(sources[name], r["tokens"], r["labels"])
        rel = abs(r["loss1"] - want) / abs(want)
        assert rel < TOL, f"{name}: step-1 loss {r['loss1']!r}, transformers' {want!r}"
        ck = r["dump"] / "checkpoint"
        source, exported = read_safetensors(sources[name]), read_safetensors(ck / f"step-{NO_STEP_EXPORT}")
        pp = LAYOUTS[layout][1].get("pipeline_parallel_degree", 1)
        if pp > 1:
            check_stage_reads(r["hf_reads"], sorted(source), pp)
        assert sorted(exported) == sorted(source), f"{name}: {sorted(set(exported) ^ set(source))}"
        assert all(exported[k].equal(v) for k, v in source.items()), name
        for step in (NO_STEP_EXPORT, STEPS):  # the whole model once, whatever stage held a tensor
            written = names_written(ck / f"step-{step}")
            assert sorted(written) == sorted(source), f"{name} step-{step}: {sorted(written)}"
        final = ck / f"step-{STEPS}"
        config = json.loads((final / "config.json").read_text())
        tied = name.endswith("_tied")
        assert config["tie_word_embeddings"] is tied and ("lm_head.weight" in read_safetensors(final)) is not tied
        assert config["rope_parameters"]["rope_type"] == ("llama3" if FAMILY[name] == "llama3" else "default")
        hf = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
        if tied:
            assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
        spec = get_model_spec(FAMILY[name])
        ours = spec.build(spec.state_dict_adapter.model_config_from_hf(config))
        ours.load_state_dict({k: torch.tensor(v) for k, v in r["weights"].items()})
        x = torch.tensor(r["tokens"])
        with torch.no_grad():
            theirs = hf(x).logits
            logits_gap = ((theirs - ours(x)).abs().max() / theirs.abs().max()).item()  # relative to the largest
        assert logits_gap < TOL, f"{name}: exported logits differ by {logits_gap} (relative)"
        gaps[name] = {"loss_rel": rel, "logits": logits_gap, "loss1": r["loss1"]}
    return gaps


def without_tensor(src: Path, dst: Path, key: str) -> Path:
    """A copy of the one-file folder ``src`` lacking tensor ``key``."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    tensors = read_safetensors(dst)
    del tensors[key]
    (dst / "model.safetensors").unlink()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _setup_error(rank: int, world: int, cfg: JobConfig) -> str | None:
    """The ValueError this rank's Trainer stops with (None: it started)."""
    from torchtitan_spmd.train import Trainer

    try:
        Trainer(cfg).close()
    except ValueError as err:
        return str(err)
    return None


def setup_errors(cfg: JobConfig, world: int) -> list[str | None]:
    """Every rank's setup error for ``cfg`` on ``world`` forked ranks (a rank left waiting in a
    collective makes it a TimeoutError)."""
    warm_parent()
    import torch.distributed.checkpoint  # noqa: F401  (import once, before forking)

    return run_forked(_setup_error, world, cfg, timeout_s=90)
