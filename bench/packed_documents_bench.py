"""Packed documents: the step time of ``attn_mask_type="block_causal"`` against ``causal``.

    python bench/packed_documents_bench.py                    # llama3 debugmodel, seq 2048, 1 process
    python bench/packed_documents_bench.py --steps 6 --rounds 2 --seq-len 2048

One process (no parallelism), fp32, no activation checkpointing, eager: the flavour ``debugmodel``
(causal: SDPA's ``is_causal``) and ``debugmodel_flex_attn`` (the same weights' shapes,
block-causal: SDPA with the boolean mask built from the per-document positions, the boundary
labels ignored), each in its own forked process, alternating ``--rounds`` times so both see the
same machine load. The step time: the median and the minimum over the steps after the first
of every round (on a shared machine the minimum is the steadier figure); also the peak resident
set (``VmHWM``) of each run and the number of documents per window. Then the attention kernel
alone (the debug model's shapes: 16 query heads, 8 key/value heads, head width 16), forward and
backward, ``is_causal`` against the block-causal boolean mask (built from the positions each
call, as the model does per layer), ``--kernel-reps`` interleaved repetitions, the minimum of
each; and the model alone (forward, loss, backward on the same batch, no trainer, both models
in this process), ``--model-reps`` interleaved repetitions, the minimum of each. The interleaved
minima are the figures to compare on a loaded machine; ``--skip-trainer`` runs only those.
Prints markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_spmd.train  # noqa: E402,F401  (imported once in the parent)
from torchtitan_spmd.config import JobConfig  # noqa: E402
from torchtitan_spmd.launcher import run_forked  # noqa: E402

FLAVORS = {"causal": "debugmodel", "block_causal": "debugmodel_flex_attn"}


def _config(flavor: str, args: argparse.Namespace) -> JobConfig:
    return JobConfig.from_dict({
        "model": {"name": "llama3", "flavor": flavor},
        "training": {"steps": args.steps, "local_batch_size": args.local_batch_size, "seq_len": args.seq_len,
                     "device": args.device, "mixed_precision_param": "float32"},
        "activation_checkpoint": {"mode": "none"},
        "lr_scheduler": {"warmup_steps": 1},
        "parallelism": {"data_parallel_shard_degree": 1},
        "debug": {"seed": 0},
    })


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _worker(rank: int, world: int, flavor: str, args: argparse.Namespace) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    with open("/proc/self/clear_refs", "w") as f:  # peak RSS from here on, not the parent's
        f.write("5")
    trainer = Trainer(_config(flavor, args))
    times, losses = [], []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        record = trainer.step(step)
        times.append(time.perf_counter() - start)
        losses.append(record.loss)
    return {"times": times, "losses": losses, "rss": _peak_rss_mib()}


def _documents_per_window(args: argparse.Namespace) -> float:
    from torchtitan_spmd.data import build_dataloader

    loader = build_dataloader(dp_rank=0, dp_degree=1, local_batch_size=args.local_batch_size,
                              seq_len=args.seq_len, seed=0)
    tokens, _ = next(loader)
    return float((tokens == 257).sum(1).float().mean()) + 1


def _kernel(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from torchtitan_spmd.distributed.inputs import document_positions
    from torchtitan_spmd.models.common import ScaledDotProductAttention

    torch.manual_seed(0)
    b, s = args.local_batch_size, args.seq_len
    tokens = torch.randint(0, 256, (b, s))
    tokens[:, torch.arange(90, s, 90)] = 257  # a document every 90 tokens, as the data's ~23 a window
    positions = document_positions(tokens, 257)
    sdpa = ScaledDotProductAttention()
    q = torch.randn(b, 16, s, 16, requires_grad=True)
    k = torch.randn(b, 8, s, 16, requires_grad=True)
    v = torch.randn(b, 8, s, 16, requires_grad=True)
    best = {"causal": float("inf"), "block_causal": float("inf")}
    for _ in range(args.kernel_reps):
        for mask in best:
            start = time.perf_counter()
            out = sdpa(q, k, v) if mask == "causal" else sdpa(q, k, v, positions)
            out.sum().backward()
            best[mask] = min(best[mask], time.perf_counter() - start)
            q.grad = k.grad = v.grad = None
    return best


def _model(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from torchtitan_spmd.data import build_dataloader
    from torchtitan_spmd.distributed.inputs import document_positions
    from torchtitan_spmd.models import get_model_spec

    spec = get_model_spec("llama3")
    models = {mask: spec.build_initialized(flavor, seed=0, max_seq_len=args.seq_len) for mask, flavor in FLAVORS.items()}
    tokens, labels = next(build_dataloader(dp_rank=0, dp_degree=1, local_batch_size=args.local_batch_size,
                                           seq_len=args.seq_len, seed=0))
    positions = document_positions(tokens, 257)
    best = {mask: float("inf") for mask in models}
    for _ in range(args.model_reps):
        for mask, model in models.items():
            start = time.perf_counter()
            logits = model(tokens) if mask == "causal" else model(tokens, positions=positions)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
            best[mask] = min(best[mask], time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--local-batch-size", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kernel-reps", type=int, default=10)
    parser.add_argument("--model-reps", type=int, default=3)
    parser.add_argument("--skip-trainer", action="store_true")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in FLAVORS}
    for _ in range(0 if args.skip_trainer else args.rounds):
        for mask, flavor in FLAVORS.items():
            runs[mask].append(run_forked(_worker, 1, flavor, args, timeout_s=1800)[0])
    print(f"llama3 debugmodel, seq {args.seq_len} x local batch {args.local_batch_size}, 1 process, fp32, "
          f"{args.steps} steps x {args.rounds} rounds; about {_documents_per_window(args):.1f} documents a window\n")
    if not args.skip_trainer:
        print("| attn_mask_type | step (s): median | min | peak RSS (MiB) | loss at the last step |")
        print("|---|---|---|---|---|")
        best = {}
        for mask, rs in runs.items():
            steps = [t for r in rs for t in r["times"][1:]]
            best[mask] = min(steps)
            print(f"| {mask} | {statistics.median(steps):.3f} | {min(steps):.3f} | {max(r['rss'] for r in rs):.0f} | "
                  f"{rs[-1]['losses'][-1]:.4f} |")
        print(f"\nblock_causal / causal step time (min): {best['block_causal'] / best['causal']:.2f}x\n")
    model = _model(args)
    print("| model alone: forward, loss, backward | min (s) |")
    print("|---|---|")
    for mask, t in model.items():
        print(f"| {mask} | {t:.3f} |")
    print(f"\nblock_causal / causal model time: {model['block_causal'] / model['causal']:.2f}x\n")
    kernel = _kernel(args)
    print("| attention kernel, forward + backward | min (ms) |")
    print("|---|---|")
    for mask, t in kernel.items():
        print(f"| {mask} | {1000 * t:.1f} |")
    print(f"\nblock_causal / causal kernel time: {kernel['block_causal'] / kernel['causal']:.2f}x")


if __name__ == "__main__":
    main()
