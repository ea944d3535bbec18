"""Hugging Face weights benchmark: load and export time, beside DCP's own format, per backend.

    python bench/hf_checkpoint_bench.py                    # 4 gloo ranks, FSDP 2 x TP 2, llama3 debugmodel sizes
    python bench/hf_checkpoint_bench.py --rounds 3 --backends default,spmd_types

A random ``LlamaForCausalLM`` of the ``debugmodel`` sizes (6.07M parameters) is saved once
by ``save_pretrained`` (float32). For each round and backend, every rank builds a trainer
that loads it (``checkpoint.initial_load_in_hf``: the load time is the trainer's own
record), then writes the model twice, timed until every rank returns: the Hugging Face
export (``last_save_in_hf``: sharded write, consolidation, ``config.json``, index) and a
DCP model-only save of the same weights. A second trainer then loads the DCP save
(``initial_load_path``). A time is the slowest rank's; the table gives medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed.checkpoint  # noqa: E402,F401  (imported once in the parent, not per rank)

import torchtitan_spmd.train  # noqa: E402,F401
from torchtitan_spmd.config import JobConfig  # noqa: E402
from torchtitan_spmd.launcher import run_forked  # noqa: E402


def _source(folder: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=320, hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=16,
        num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})).save_pretrained(folder)
    return folder


def _config(backend: str, dump: str, load: str, hf: bool) -> JobConfig:
    return JobConfig.from_dict({
        "job": {"dump_folder": dump},
        "model": {"name": "llama3", "flavor": "debugmodel"},
        "training": {"steps": 10, "local_batch_size": 2, "seq_len": 64, "device": "cpu",
                     "mixed_precision_param": "float32"},
        "parallelism": {"spmd_backend": backend, "data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
        "checkpoint": {"enable": True, "initial_load_path": load, "initial_load_in_hf": hf,
                       "last_save_in_hf": hf},
    })


def _rank(rank: int, world: int, backend: str, dump: str, source: str) -> dict[str, float]:
    import torch.distributed as dist

    from torchtitan_spmd.train import Trainer

    trainer = Trainer(_config(backend, dump, source, True))
    out = {"hf load": trainer.checkpointer.loaded["seconds"]}
    for name, step, hf in (("hf export", 1, True), ("dcp save", 2, False)):
        dist.barrier()
        trainer.checkpointer.config.last_save_in_hf = hf
        begin = time.perf_counter()
        trainer.checkpointer.save(step, last_step=True)
        out[name] = time.perf_counter() - begin
    trainer.close()
    dcp = Trainer(_config(backend, dump + "-dcp", os.path.join(dump, "checkpoint", "step-2"), False))
    out["dcp load"] = dcp.checkpointer.loaded["seconds"]
    dcp.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="default,full_dtensor,spmd_types")
    args = parser.parse_args()
    backends = args.backends.split(",")
    root = tempfile.mkdtemp(prefix="hfbench-")
    try:
        source = _source(os.path.join(root, "source"))
        times: dict[str, dict[str, list[float]]] = {b: {} for b in backends}
        for r in range(args.rounds):
            for backend in backends:  # interleaved: machine noise spreads over every backend
                dump = os.path.join(root, f"{backend}-{r}")
                per_rank = run_forked(_rank, 4, backend, dump, source, timeout_s=600)
                for key in per_rank[0]:
                    times[backend].setdefault(key, []).append(max(p[key] for p in per_rank))
                shutil.rmtree(dump, ignore_errors=True)
                shutil.rmtree(dump + "-dcp", ignore_errors=True)
        keys = list(times[backends[0]])
        print(f"| backend | {' | '.join(f'{k} (s)' for k in keys)} |")
        print(f"|---|{'---|' * len(keys)}")
        for backend in backends:
            print(f"| `{backend}` | " + " | ".join(f"{statistics.median(times[backend][k]):.2f}" for k in keys) + " |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
