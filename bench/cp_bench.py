"""Context-parallel benchmark: attention activation memory per rank and step time vs the CP degree.

    python bench/cp_bench.py                          # seq 4096, CP 1, 2, 4, spmd_types
    python bench/cp_bench.py --seq-len 2048 --cp 1,2 --backend full_dtensor

One forked gloo job per CP degree (``cp`` ranks, no data or tensor parallelism, so the
global batch is the same), the llama3 ``debugmodel`` widths with ``--layers`` layers and a
RoPE table long enough for ``--seq-len`` (a flavour defined here, in the parent, before
forking). Per rank it reports:

- **attention activation memory**: the bytes the attention kernels (the plan's
  ``attention`` modules: SDPA over the gathered keys and values) save for backward, summed
  over the layers (unique storages, counted by ``torch.autograd.graph.saved_tensors_hooks``
  around each kernel call), in the last measured step;
- of which **the CP mask** (one ``[seq/cp, seq]`` float tensor per step, shared by every
  layer), and the rest per layer (queries, the gathered keys and values, outputs);
- **step time**: the median over the measured steps (after ``--warmup``), rank 0.

``cp == 1`` is the same model without context parallelism (the causal SDPA on full
sequences). Times depend on the machine and its load: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch._inductor  # noqa: E402,F401  (imported once in the parent, not per rank)

import torchtitan_spmd.train  # noqa: E402,F401
from torchtitan_spmd.config import JobConfig  # noqa: E402
from torchtitan_spmd.distributed.plan import fqn_matches  # noqa: E402
from torchtitan_spmd.launcher import run_forked  # noqa: E402
from torchtitan_spmd.models import llama3  # noqa: E402

FLAVOR = "cp_bench"


def _config(args: argparse.Namespace, cp: int) -> JobConfig:
    return JobConfig.from_dict({
        "model": {"name": "llama3", "flavor": FLAVOR},
        "training": {"steps": args.warmup + args.steps, "local_batch_size": 1, "seq_len": args.seq_len,
                     "device": "cpu", "max_norm": 1.0},
        "parallelism": {"spmd_backend": args.backend, "data_parallel_shard_degree": 1,
                        "context_parallel_degree": cp},
        "debug": {"seed": 0},
    })


def _rank(rank: int, world: int, cfg: JobConfig) -> dict[str, Any]:
    torch.set_num_threads(1)
    trainer = torchtitan_spmd.train.Trainer(cfg)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        saved[s.data_ptr()] = s.nbytes()
        return t

    hooks: list[Any] = []

    def enter(*_: Any) -> None:
        ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        ctx.__enter__()
        hooks.append(ctx)

    def leave(*_: Any) -> None:
        hooks.pop().__exit__(None, None, None)

    for fqn, module in trainer.model.named_modules():
        if any(fqn_matches(p, fqn.removeprefix("_orig_mod.")) for p in trainer.plan.attention):
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)
    times, last = [], 0
    for step in range(1, cfg.training.steps + 1):
        saved.clear()
        start = time.perf_counter()
        trainer.step(step)
        times.append(time.perf_counter() - start)
        last = sum(saved.values())
    cp = trainer.context_parallel
    masks = {m.untyped_storage().data_ptr() for m in (cp._masks.values() if cp is not None else ())}
    mask_bytes = sum(n for ptr, n in saved.items() if ptr in masks)
    return {"attention_saved_bytes": last, "mask_bytes": mask_bytes, "step_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cp", default="1,2,4", help="comma-separated CP degrees")
    parser.add_argument("--backend", default="spmd_types", choices=("spmd_types", "full_dtensor"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="measured steps")
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    base = llama3.FLAVORS["debugmodel"]
    llama3.FLAVORS[FLAVOR] = dataclasses.replace(base, n_layers=args.layers, max_seq_len=args.seq_len)
    load = os.getloadavg()[0]
    print(f"seq {args.seq_len}, batch 1, llama3 debugmodel widths, {args.layers} layers, {args.backend}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load:.1f} at start\n")
    print("| CP | ranks | attention saved for backward per rank (MiB) | × CP 1 | of which the CP mask (MiB) "
          "| without the mask, per layer (MiB) | median step (s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    first = None
    for cp in (int(c) for c in args.cp.split(",")):
        per_rank = run_forked(_rank, cp, _config(args, cp), timeout_s=3600)
        mem = max(r["attention_saved_bytes"] for r in per_rank) / 2**20
        mask = max(r["mask_bytes"] for r in per_rank) / 2**20
        first = first or mem
        step = statistics.median(per_rank[0]["step_s"][args.warmup:])
        print(f"| {cp} | {cp} | {mem:.1f} | {mem / first:.2f} | {mask:.1f} | {(mem - mask) / args.layers:.1f} "
              f"| {step:.2f} |", flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
