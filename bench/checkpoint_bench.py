"""Checkpoint benchmark: save and load time and size, sync vs async, what an async save costs a step,
and what the per-file checksums cost.

    python bench/checkpoint_bench.py                  # 4 gloo ranks, FSDP 2 x TP 2, llama3 debugmodel
    python bench/checkpoint_bench.py --rounds 5 --folder /tmp/ckbench
    python bench/checkpoint_bench.py --hash blake2b   # checksums with blake2b instead of crc32
    python bench/checkpoint_bench.py --hash none      # the baseline: no checksums
    python bench/checkpoint_bench.py --hash-only      # only the hashes' cost per GiB, on one 256 MiB file
    python bench/checkpoint_bench.py --hash-ab --rounds 7  # blocking saves, crc32 / none / blake2b interleaved

Every rank builds one trainer (``[checkpoint]`` on), trains ``--warmup`` steps, then for
each round, alternately in sync and async mode: one save of the full state (model,
optimizer, LR scheduler, data position, step, RNG) timed until it returns (sync: written
and visible; async: staged) and until it is visible; the next ``--steps-after`` steps
timed (the async write runs in the background during them); and then ``--steps-after``
steps with no save in flight, the baseline. Then it loads the newest checkpoint into a
fresh trainer, timed. A time is the slowest rank's; the table gives medians over rounds.
The checksum columns: the time each rank spent hashing its files (in the save: after writing
them; in the load: verifying them before DCP reads), the slowest rank's, and that as a share
of the save's visible time; the last line is the per-step stop-signal check (one all-reduce).
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


def _config(args: argparse.Namespace, folder: str, async_mode: str) -> JobConfig:
    return JobConfig.from_dict({
        "job": {"dump_folder": folder},
        "model": {"name": args.model, "flavor": args.flavor},
        "training": {"steps": 10_000, "local_batch_size": args.local_batch_size, "seq_len": args.seq_len,
                     "device": "cpu"},
        "parallelism": {"data_parallel_shard_degree": args.dp_shard, "tensor_parallel_degree": args.tp,
                        "spmd_backend": args.backend},
        "checkpoint": {"enable": True, "async_mode": async_mode, "keep_latest_k": 0, "interval": 1},
        "debug": {"seed": 0},
    })


def _steps(trainer: object, first: int, n: int) -> list[float]:
    out = []
    for step in range(first, first + n):
        start = time.perf_counter()
        trainer.step(step)  # type: ignore[attr-defined]
        out.append(time.perf_counter() - start)
    return out


def _timed_hashing(algorithm: str) -> dict[str, float]:
    """Use ``algorithm`` for new checksums and accumulate the time spent hashing (``"s"``, ``"bytes"``)."""
    import torchtitan_spmd.checkpoint.integrity as integrity

    if algorithm == "none":  # the baseline: no checksums written, none verified
        integrity.RecordingWriter._record = lambda self, relative: None  # type: ignore[method-assign]
        integrity.verify_checkpoint = lambda *args, **kwargs: []  # type: ignore[assignment]
    else:
        integrity.HASH_ALGORITHM = algorithm
    spent = {"s": 0.0, "cpu": 0.0, "bytes": 0.0}
    digest = integrity.file_digest

    def timed(path: str, *more: str) -> tuple[int, str]:
        start, cpu = time.perf_counter(), time.thread_time()
        size, value = digest(path, *more)
        spent["cpu"] += time.thread_time() - cpu
        spent["s"] += time.perf_counter() - start
        spent["bytes"] += size
        return size, value

    integrity.file_digest = timed  # type: ignore[assignment]
    return spent


def _worker(rank: int, world: int, args: argparse.Namespace, folder: str) -> dict[str, list[float]]:
    import torch.distributed as dist

    from torchtitan_spmd.tools.signals import StopRequest
    from torchtitan_spmd.train import Trainer

    spent = _timed_hashing(args.hash)

    trainers = {mode: Trainer(_config(args, os.path.join(folder, mode), mode)) for mode in ("disabled", "async")}
    out: dict[str, list[float]] = {}
    for trainer in trainers.values():
        _steps(trainer, 1, args.warmup)
    step = args.warmup + 1
    for _ in range(args.rounds):
        for mode, trainer in trainers.items():
            dist.barrier()
            hashed = dict(spent)
            start, cpu = time.perf_counter(), time.process_time()
            trainer.checkpointer.save(step)  # interval 1: a full save; async in async mode
            returned = time.perf_counter()
            out.setdefault(f"{mode}/save_cpu", []).append(time.process_time() - cpu)
            out.setdefault(f"{mode}/returns", []).append(returned - start)
            visible = [returned]
            future = trainer.checkpointer.save_future
            if future is not None:  # async: visible when the background write and the rename are done
                future.add_done_callback(lambda _, v=visible: v.__setitem__(0, time.perf_counter()))
            after = _steps(trainer, step + 1, args.steps_after)
            trainer.checkpointer.wait()
            out.setdefault(f"{mode}/visible", []).append(visible[0] - start)
            out.setdefault(f"{mode}/hash_save", []).append(spent["s"] - hashed["s"])
            out.setdefault(f"{mode}/hash_save_cpu", []).append(spent["cpu"] - hashed["cpu"])
            out.setdefault(f"{mode}/hash_save_bytes", []).append(spent["bytes"] - hashed["bytes"])
            dist.barrier()
            base = _steps(trainer, step + 1 + args.steps_after, args.steps_after)
            out.setdefault(f"{mode}/step_after_save", []).extend(after)
            out.setdefault(f"{mode}/step_baseline", []).extend(base)
        step += 1 + 2 * args.steps_after
    for mode, trainer in trainers.items():
        trainer.close()
        dist.barrier()
        hashed = dict(spent)
        start = time.perf_counter()
        fresh = Trainer(_config(args, os.path.join(folder, mode), mode))
        out[f"{mode}/load"] = [time.perf_counter() - start]
        out[f"{mode}/hash_load"] = [spent["s"] - hashed["s"]]
        out[f"{mode}/load_inside"] = [fresh.checkpointer.loaded["seconds"]]
        fresh.close()
    stop, checks = StopRequest(), []
    for _ in range(50):
        start = time.perf_counter()
        stop.agreed(world)
        checks.append(time.perf_counter() - start)
    out["stop_check"] = [statistics.median(checks)]
    return out


AB_MODES = ("crc32", "none", "blake2b")


def _ab_worker(rank: int, world: int, args: argparse.Namespace, folder: str) -> dict[str, list[float]]:
    """Blocking saves of one trainer, the checksum mode changing save by save, in ABC CBA order
    (crc32, none, blake2b, blake2b, none, crc32, ...): each save's visible time, by mode."""
    import torch.distributed as dist

    import torchtitan_spmd.checkpoint.integrity as integrity
    from torchtitan_spmd.train import Trainer

    record, verify = integrity.RecordingWriter._record, integrity.verify_checkpoint
    trainer = Trainer(_config(args, os.path.join(folder, "ab"), "disabled"))
    _steps(trainer, 1, args.warmup)
    out: dict[str, list[float]] = {}
    step = args.warmup
    for i in range(args.rounds):
        for mode in AB_MODES if i % 2 == 0 else AB_MODES[::-1]:
            integrity.RecordingWriter._record = (  # type: ignore[method-assign]
                (lambda self, relative: None) if mode == "none" else record)
            integrity.HASH_ALGORITHM = "crc32" if mode == "none" else mode
            step += 1
            dist.barrier()
            start = time.perf_counter()
            trainer.checkpointer.save(step)
            out.setdefault(mode, []).append(time.perf_counter() - start)
    integrity.RecordingWriter._record = record  # type: ignore[method-assign]
    integrity.verify_checkpoint = verify  # type: ignore[assignment]
    trainer.close()
    return out


def hash_cost(size_mib: int = 256, rounds: int = 3) -> dict[str, float]:
    """Seconds per GiB of each hash over one ``size_mib`` file (in the page cache), interleaved;
    the best of ``rounds``."""
    from torchtitan_spmd.checkpoint.integrity import file_digest

    best: dict[str, float] = {}
    with tempfile.NamedTemporaryFile(prefix="hashbench-") as f:
        f.write(os.urandom(size_mib << 20))
        f.flush()
        for _ in range(rounds):
            for algorithm in ("crc32", "blake2b"):
                start = time.perf_counter()
                file_digest(f.name, algorithm)
                seconds = (time.perf_counter() - start) * 1024 / size_mib
                best[algorithm] = min(best.get(algorithm, seconds), seconds)
    return best


def _size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="default")
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--dp-shard", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--local-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-after", type=int, default=2)
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--hash", default="crc32", choices=("crc32", "blake2b", "none"),
                        help="the checksum of each file (none: the baseline without checksums)")
    parser.add_argument("--hash-only", action="store_true", help="only the hashes' cost per GiB")
    parser.add_argument("--hash-ab", action="store_true",
                        help="only blocking saves, the checksum (crc32, none, blake2b) changing save by save "
                             "(ABC CBA order)")
    args = parser.parse_args(argv)
    cost = hash_cost()
    print("hashing a 256 MiB file in the page cache (best of 3, interleaved): "
          + ", ".join(f"{a} {s:.3f} s/GiB ({1 / s:.2f} GiB/s)" for a, s in cost.items()))
    if args.hash_only:
        return 0
    if args.hash_ab:
        folder = args.folder or tempfile.mkdtemp(prefix="ckbench-")
        try:
            per_rank = run_forked(_ab_worker, args.dp_shard * args.tp, args, folder, timeout_s=3600)
        finally:
            if args.folder is None:
                shutil.rmtree(folder, ignore_errors=True)
        slowest = {m: [max(r[m][i] for r in per_rank) for i in range(args.rounds)] for m in AB_MODES}
        base = statistics.median(slowest["none"])
        print(f"blocking saves, checksum changing save by save, {args.rounds} rounds; load average: "
              f"{os.getloadavg()[0]:.1f}")
        print("| checksums | save visible (s), median | vs none |")
        print("|---|---|---|")
        for mode in AB_MODES:
            med = statistics.median(slowest[mode])
            print(f"| {mode} | {med:.3f} | {100 * (med - base) / base:+.1f} % |")
        return 0
    folder = args.folder or tempfile.mkdtemp(prefix="ckbench-")
    world = args.dp_shard * args.tp
    try:
        per_rank = run_forked(_worker, world, args, folder, timeout_s=3600)
        slowest = {k: [max(r[k][i] for r in per_rank) for i in range(len(per_rank[0][k]))] for k in per_rank[0]}
        med = {k: statistics.median(v) for k, v in slowest.items()}
        print(f"{args.model}/{args.flavor}, {args.backend}, {world} ranks (dp_shard={args.dp_shard}, tp={args.tp}), "
              f"local batch {args.local_batch_size} x seq {args.seq_len}; {args.rounds} rounds; "
              f"load average before: {os.getloadavg()[0]:.1f}")
        print(f"checksums: {args.hash}")
        print("| mode | save returns (s) | visible (s) | size (MiB) | load (s): in load() / whole trainer start "
              "| step during the write (s) | step without (s) | hashing in the save (s) | of the visible save "
              "| verifying at load (s) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for mode in ("disabled", "async"):
            ck = Path(folder) / mode / "checkpoint"
            newest = max(ck.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
            print(f"| {'sync' if mode == 'disabled' else 'async'} | {med[mode + '/returns']:.2f} | "
                  f"{med[mode + '/visible']:.2f} | {_size_mib(newest):.1f} | "
                  f"{med[mode + '/load_inside']:.2f} / {med[mode + '/load']:.2f} | "
                  f"{med[mode + '/step_after_save']:.2f} | {med[mode + '/step_baseline']:.2f} | "
                  f"{med[mode + '/hash_save']:.3f} | {100 * med[mode + '/hash_save'] / med[mode + '/visible']:.1f} % | "
                  f"{med[mode + '/hash_load']:.3f} |")
        hashed = statistics.median(sum(r["disabled/hash_save_bytes"][i] for r in per_rank)
                                   for i in range(args.rounds)) / 2**20
        print(f"bytes hashed per save, all ranks: {hashed:.1f} MiB; the per-step stop check (one all-reduce): "
              f"{1e3 * med['stop_check']:.2f} ms")
        print(f"CPU time of a blocking save on the slowest rank: {med['disabled/save_cpu']:.3f} s, of which hashing "
              f"{med['disabled/hash_save_cpu']:.3f} s "
              f"({100 * med['disabled/hash_save_cpu'] / med['disabled/save_cpu']:.1f} %; contention-independent)")
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
