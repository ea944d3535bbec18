"""Step time of a tied model (``enable_weight_tying``) at FSDP 2 x TP 2: the table replicated on
``tp`` (the plan before: every TP rank computes every logit) against vocab-parallel (the plan
now: ``S(0)@tp`` on both sides), per backend, interleaved in one run.

    python bench/tied_bench.py
    python bench/tied_bench.py --backends default --steps 12 --flavor debugmodel
    python bench/tied_bench.py --vocab 32768    # a WordLevel tokenizer of 32,768 ids (hf_assets_path)

Every rank builds one trainer per (backend, plan) on the same data and seed, the family's
flavour with ``enable_weight_tying=True``; the steps are interleaved (step 1 of every variant,
then step 2, ...; the order rotates every step). The ``replicated`` variant's plan is the
vocab-parallel one with the two tied entries restated as before (the embedding's and the
output's weight ``R@tp``; the output computes every vocabulary column from the gathered
sequence and keeps its slice of them). The first ``--warmup`` steps are dropped; a step's wall
time is its slowest rank's. ``--vocab N``: the vocabulary is a local WordLevel tokenizer's of
``N`` ids on a text of random words of it; otherwise the byte tokenizer's 320. Also prints each variant's first loss (both plans compute the same
model: they agree to float32 rounding).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch._inductor  # noqa: E402,F401  (imported once in the parent, not per rank)

import torchtitan_spmd.train  # noqa: E402,F401
from torchtitan_spmd.config import JobConfig  # noqa: E402
from torchtitan_spmd.distributed.plan import ModulePlan, Redistribute  # noqa: E402
from torchtitan_spmd.launcher import run_forked  # noqa: E402
from torchtitan_spmd.models import get_model_spec  # noqa: E402

TIED = "bench_tied"
PLANS = ("replicated", "vocab_parallel")


def _replicated(plan_fn: Any) -> Any:
    """``plan_fn`` with a tied model's table replicated on ``tp`` (the plan before vocab parallelism)."""

    def plan(config: Any = None, **kwargs: Any) -> Any:
        p = plan_fn(config, **kwargs)
        untied = plan_fn(dataclasses.replace(config, enable_weight_tying=False), **kwargs)
        out = untied.modules["output"]
        gathered = out.inputs[0]
        assert isinstance(gathered, Redistribute)
        logits = out.output.dst if isinstance(out.output, Redistribute) else out.output
        modules = dict(p.modules)
        modules["tok_embeddings"] = untied.modules["tok_embeddings"]  # weight R@tp, a local slice onto the residual
        modules["output"] = ModulePlan(params={"weight": untied.modules["tok_embeddings"].params["weight"]},
                                       inputs=out.inputs, output=Redistribute(gathered.dst, logits))
        return dataclasses.replace(p, modules=modules)

    return plan


def _config(backend: str, args: argparse.Namespace) -> JobConfig:
    return JobConfig.from_dict({
        **({"hf_assets_path": args.assets, "dataloader": {"dataset": "text", "dataset_path": os.path.join(
            args.assets, "corpus.txt")}} if args.assets else {}),
        "model": {"name": args.model, "flavor": TIED},
        "training": {"steps": args.steps, "local_batch_size": args.local_batch_size, "seq_len": args.seq_len,
                     "device": "cpu", "mixed_precision_param": "float32"},
        "activation_checkpoint": {"mode": "none"},
        "lr_scheduler": {"warmup_steps": 2},
        "parallelism": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2, "spmd_backend": backend},
        "debug": {"seed": 0},
    })


def _worker(rank: int, world: int, variants: list[tuple[str, str]], args: argparse.Namespace) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    spec = get_model_spec(args.model)
    vocab_parallel = spec.sharding_plan
    trainers = {}
    for backend, plan in variants:
        object.__setattr__(spec, "sharding_plan", _replicated(vocab_parallel) if plan == "replicated" else vocab_parallel)
        try:
            trainers[f"{backend} {plan}"] = Trainer(_config(backend, args))
        finally:
            object.__setattr__(spec, "sharding_plan", vocab_parallel)
    times: dict[str, list[float]] = {v: [] for v in trainers}
    losses: dict[str, float] = {}
    order = list(trainers)
    for step in range(1, args.steps + 1):
        for v in order[step % len(order):] + order[:step % len(order)]:
            start = time.perf_counter()
            record = trainers[v].step(step)
            times[v].append(time.perf_counter() - start)
            if step == 1:
                losses[v] = record.loss
    layouts = {v: repr(t.state_layouts["output.weight"].layout) for v, t in trainers.items()}
    return {"times": times, "losses": losses, "layouts": layouts}


def _available() -> list[str]:
    """The backends with a runtime in this build (a stack prefix may lack ``spmd_types``)."""
    from torchtitan_spmd.distributed.representation import get_representation

    out = []
    for name in ("default", "full_dtensor", "spmd_types"):
        try:
            get_representation(name)
        except ValueError:
            continue
        out.append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default=",".join(_available()))
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--local-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=None, help="a WordLevel tokenizer of this many ids")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        args.assets = None
        if args.vocab:
            import random

            from tokenizers import Tokenizer
            from tokenizers.models import WordLevel
            from tokenizers.pre_tokenizers import WhitespaceSplit

            tok = Tokenizer(WordLevel({f"t{i}": i for i in range(args.vocab)}, unk_token="t0"))
            tok.pre_tokenizer = WhitespaceSplit()
            tok.save(os.path.join(folder, "tokenizer.json"))
            with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
                f.write('{"bos_token": "t0", "eos_token": "t1"}')
            rng = random.Random(0)  # random words of the vocabulary, one document per line
            with open(os.path.join(folder, "corpus.txt"), "w") as f:
                for _ in range(64):
                    f.write(" ".join(f"t{rng.randrange(args.vocab)}" for _ in range(2048)) + "\n")
            args.assets = folder
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    spec = get_model_spec(args.model)
    spec.flavors[TIED] = dataclasses.replace(spec.flavors[args.flavor], enable_weight_tying=True)  # type: ignore[index]
    variants = [(b, p) for b in args.backends.split(",") if b for p in PLANS]
    start = time.perf_counter()
    per_rank = run_forked(_worker, 4, variants, args, timeout_s=3600)
    wall = time.perf_counter() - start
    names = list(per_rank[0]["times"])
    cfg = spec.model_config(TIED)
    print(f"\n4 gloo ranks, FSDP 2 x TP 2 (sequence and loss parallel), {args.model} {args.flavor} tied "
          f"(dim {cfg.dim}, vocabulary {args.vocab or 320}), local batch "
          f"{args.local_batch_size} x seq {args.seq_len}, fp32, {args.steps - args.warmup} measured steps "
          f"after {args.warmup} warm-up, interleaved; wall {wall:.0f} s\n")
    print("| backend | output weight | median step (s) | min (s) | after / before | step-1 loss |")
    print("|---|---|---|---|---|---|")
    med = {}
    for v in names:
        steps = [max(r["times"][v][i] for r in per_rank) for i in range(args.steps)][args.warmup:]
        med[v] = statistics.median(steps)
        backend, plan = v.split()
        ratio = "" if plan == "replicated" else f"{med[v] / med[f'{backend} replicated']:.2f}x"
        print(f"| {backend} | {per_rank[0]['layouts'][v]} ({plan}) | {med[v]:.3f} | {min(steps):.3f} | {ratio} | "
              f"{per_rank[0]['losses'][v]:.6f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
