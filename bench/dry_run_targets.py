"""The dry run's targets (issue 36): wall time, peak RSS and the report's headline numbers.

    PYTHONPATH=. python bench/dry_run_targets.py [405b|8b|qwen3_30b|dsv3_671b|all] [--json OUT]

Each target runs in a fresh subprocess (its peak RSS is its own) with ``NGPU`` set, through the
trainer's own entry point (``python -m torchtitan_spmd.train ... --comm.mode fake_backend``).

Upstream's real flavours (llama3 ``8B`` and ``405B``, qwen3 ``30B-A3B``, deepseek_v3 ``671B``) are
in this library's registry; the script builds a local WordLevel ``tokenizer.json`` of upstream's
vocabulary size (128,256 for llama3, 151,936 for qwen3, 129,280 for deepseek_v3), so that the
model's vocabulary is the real one.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

#: name -> (family, flavour, vocabulary, NGPU, extra command-line arguments)
TARGETS: dict[str, tuple[str, str, int, int, list[str]]] = {
    # upstream's 405B recipe layout at 16,384 GPUs: TP 8 x PP 16 x FSDP 128
    "405b": ("llama3", "405B", 128256, 16384, [
        "--parallelism.tensor_parallel_degree", "8", "--parallelism.pipeline_parallel_degree", "16",
        "--parallelism.pipeline_parallel_schedule", "1F1B",
        "--training.seq_len", "8192", "--training.local_batch_size", "16",
        "--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "bfloat16"]),
    "8b": ("llama3", "8B", 128256, 64, [
        "--training.seq_len", "8192", "--training.local_batch_size", "1",
        "--activation_checkpoint.mode", "selective", "--training.mixed_precision_param", "bfloat16"]),
    # DeepSeek-V3's own layout on 2,048 GPUs (its technical report: 16-way PP, 64-way EP, data
    # parallelism over the rest): PP 16 x FSDP 128, EP 64 borrowed from FSDP (efsdp 2)
    "dsv3_671b": ("deepseek_v3", "671B", 129280, 2048, [
        "--parallelism.pipeline_parallel_degree", "16", "--parallelism.expert_parallel_degree", "64",
        "--parallelism.pipeline_parallel_schedule", "1F1B",
        "--training.seq_len", "4096", "--training.local_batch_size", "16",
        "--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "bfloat16"]),
    "qwen3_30b": ("qwen3", "30B-A3B", 151936, 512, [
        "--parallelism.expert_parallel_degree", "8", "--parallelism.tensor_parallel_degree", "1",
        "--training.seq_len", "4096", "--training.local_batch_size", "1",
        "--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "bfloat16"]),
}


def word_level_tokenizer(folder: str, vocab: int) -> str:
    """A ``tokenizer.json`` of exactly ``vocab`` ids in ``folder`` (a WordLevel model; the dry run
    reads only its size)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.save(os.path.join(folder, "tokenizer.json"))
    return folder


def _child(target: str, folder: str) -> None:
    """Run one target in this process (the subprocess side)."""
    from torchtitan_spmd.train import main

    family, flavour, _, _, extra = TARGETS[target]
    status = main(["--module", family, "--config", f"{family}_debugmodel", "--model.flavor", flavour,
                   "--hf_assets_path", folder, "--comm.mode", "fake_backend",
                   "--job.dump_folder", folder, *extra])
    raise SystemExit(status)


def run(target: str) -> dict:
    """One target in a subprocess: its wall time, peak RSS and the report's JSON."""
    family, flavour, vocab, ngpu, _ = TARGETS[target]
    with tempfile.TemporaryDirectory() as folder:
        word_level_tokenizer(folder, vocab)
        env = {**os.environ, "NGPU": str(ngpu), "OMP_NUM_THREADS": "1"}
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", target, folder], env=env,
                              capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
        rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
        if proc.returncode != 0:
            raise SystemExit(f"{target}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(os.path.join(folder, "dry_run.json"), encoding="utf-8") as f:
            report = json.load(f)
    return {"target": target, "model": f"{family}/{flavour}", "ngpu": ngpu, "wall_s": round(wall, 1),
            "max_rss_gib_of_any_child_so_far": round(rss_gib, 2), "text": proc.stdout, "report": report}


def main() -> None:
    """Run the targets named on the command line (default: all) and print a table."""
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2], sys.argv[3])
        return
    names = [a for a in sys.argv[1:] if not a.startswith("--") and a in TARGETS] or list(TARGETS)
    rows = []
    for name in names:
        row = run(name)
        rows.append(row)
        print(row["text"])
        print(f"{name}: {row['wall_s']} s, peak RSS {row['max_rss_gib_of_any_child_so_far']} GiB", flush=True)
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
