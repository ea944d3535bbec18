"""The cost of the Hugging Face data path: tokenising and packing global batches.

Every data-parallel rank tokenises the documents of the whole global batch and keeps its
own rows (``torchtitan_spmd/data/hf_datasets.py``), so a rank pays for ``G x (seq_len+1)``
tokens a step whatever the data-parallel degree. This measures that rate (global-batch
tokens per second on one thread) for the shipped fixture tokenizer on the shipped
``c4_test`` stand-in (its 48 documents written 40 times into a temporary JSON lines file,
so that no document is still tokenised from a previous pass), against the byte tokenizer
on the same documents, and the start-up cost (``datasets.load_dataset`` of the file, the
first time, when ``datasets`` writes its Arrow cache, then warm).

    OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 PYTHONPATH=$PWD python bench/data_bench.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "tests" / "assets"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    from torchtitan_spmd.data import HuggingFaceTokenizer, Tokenizer, build_dataloader

    torch.set_num_threads(1)
    import tempfile

    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "docs.jsonl")
    lines = (ASSETS / "c4_test" / "data.json").read_text(encoding="utf-8").splitlines()
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines * 40) + "\n")
    rows = []
    for name, tok in (("hf (tests/assets/tokenizer)", HuggingFaceTokenizer(str(ASSETS / "tokenizer"))),
                      ("byte", Tokenizer())):
        rates, loads = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            it = build_dataloader(dp_rank=0, dp_degree=1, local_batch_size=args.global_batch, seq_len=args.seq_len,
                                  seed=0, dataset="json", dataset_path=path, tokenizer=tok)
            loads.append(time.perf_counter() - start)
            steps = 0
            start = time.perf_counter()
            while time.perf_counter() - start < 2.0:
                next(it)
                steps += 1
            elapsed = time.perf_counter() - start
            rates.append(steps * args.global_batch * (args.seq_len + 1) / elapsed)
        rows.append((name, statistics.median(rates), loads))
    print(f"global batch {args.global_batch} x {args.seq_len + 1} tokens, median of {args.repeats}")
    print("| tokenizer | global-batch tokens/s (one thread) | ms per global batch | load_dataset, cold / warm (s) |")
    print("|---|---|---|---|")
    for name, rate, loads in rows:
        ms = 1e3 * args.global_batch * (args.seq_len + 1) / rate
        print(f"| {name} | {rate:,.0f} | {ms:.1f} | {loads[0]:.2f} / {statistics.median(loads[1:] or loads):.2f} |")


if __name__ == "__main__":
    main()
