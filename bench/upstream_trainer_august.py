"""Upstream's own trainer (``torchtitan/train.py`` at b5bcd76, August 2026) on this library, on CPU.

A measuring tool for issue 32 ("a real client"): it runs upstream's trainer twice on the same
job, once from upstream's tree as it is (``unmodified``) and once from a copy of that tree
that is a fork of it on this library (``library``): there the two modules that hold
upstream's config sections and ``ParallelDims`` (``torchtitan/config/configs.py``,
``torchtitan/distributed/parallel_dims.py``) only re-export this library's classes, and
the fork declares its surface (``TORCHTITAN_SPMD_SURFACE=august``). No other upstream
file is touched, and no upstream code is copied into this repository.

    python bench/upstream_trainer_august.py setup            # export b5bcd76, the fork, the data
    python bench/upstream_trainer_august.py table            # every job, both trees: the table
    python bench/upstream_trainer_august.py run --tree library --backend spmd_types --dp 2 --tp 2

Upstream's trainer has no CPU device path, so every rank first runs :func:`_cpu_patches`
(from outside: no upstream file changes), the same on both trees:

1. the device type is ``cpu`` (upstream reads ``torch._utils._get_available_device_type()
   or "cuda"``), so its process group is gloo; ``torch.cpu`` gets the few memory-monitor
   calls upstream makes (no-ops);
2. FSDP2 reduces with ``SUM`` and divides afterwards (its ``force_sum_reduction_for_comms``
   path), since gloo has neither ``PREMUL_SUM`` nor ``AVG``: upstream sets a gradient divide
   factor of 1.0, so the arithmetic is the same;
3. ``set_pg_timeouts``: a barrier without ``device_ids`` (``torch.cpu.current_device()`` is
   a string), then upstream's own ``torch.distributed.set_timeout`` per group;
4. attention: FlexAttention has no backward on CPU, so its compiled kernel is replaced by
   SDPA with the ``BlockMask`` materialised as a dense boolean mask (the same math, another
   kernel); ``set_determinism`` re-compiles the kernel, so it is re-applied after that;
5. the block mask is built by eager ``create_block_mask`` instead of upstream's compiled one
   (the same boolean mask; inductor's C++ compile of it costs minutes per run on this CPU).

Data: ``tests/assets/c4_test/data.json`` is absent from the local mirror; both trees get
the same stand-in, written by ``../shared/peer-torchtitan/make_c4_standin.py`` (text that
ships with CPython). Upstream's data loader needs ``grain`` (its pin, 0.2.18) and
``einops``; ``setup`` does not install them: give their folder with ``--deps`` (``pip
install --target DIR --no-deps grain==0.2.18 einops array-record cloudpickle etils
portpicker``). spmd_types is the interpreter's (0.3.1), or ``--spmd-types DIR`` (a ``pip
install --target`` folder, e.g. 0.2.3, upstream's pin) put first on ``PYTHONPATH``.

The job, both trees: ``llama3`` ``llama3_debugmodel``, 4 gloo ranks, ``--debug.seed 42
--debug.deterministic``, fp32 parameters, no activation checkpointing (validation and checkpoints are off
in that config), ``OMP_NUM_THREADS=1``, 5 steps, 4 sequences of 256 tokens per microbatch per dp
rank (``--training.num_tokens_per_microbatch_per_dp_rank 1024 --training.max_context_length
256``); with PP, as many pipeline microbatches as stages' ranks (``--parallelism.num_pp_microbatches``)
and ``--training.disable_cuda_graphs``. The table is rank 0's logged loss and grad norm per step
(under PP rank 0 is the first stage; upstream logs the loss on the last stage's ranks, so the
PP runs use ``--local-ranks-filter`` on the last rank).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
MIRROR = "/work/.mirror/pytorch+torchtitan/repo"
#: ``../shared/peer-torchtitan`` beside the main checkout (a worktree sits one level deeper).
STANDIN = next((p / "shared" / "peer-torchtitan" / "make_c4_standin.py" for p in (HERE.parent, HERE.parent.parent)
                if (p / "shared" / "peer-torchtitan").is_dir()), HERE.parent / "shared" / "peer-torchtitan")
DEFAULT_WORK = Path(tempfile.gettempdir()) / "upstream_trainer_august"
#: Blobs absent from the local mirror (``git archive`` stops at them).
MISSING = ("tests/assets/c4_test/data.json",)

#: The import switch: each of upstream's two modules becomes a re-export of this library's,
#: of the names upstream's module offers at that commit (its ``__all__``, else its classes).
SWITCHED = {
    "torchtitan/config/configs.py": "torchtitan_spmd.config.configs",
    "torchtitan/distributed/parallel_dims.py": "torchtitan_spmd.distributed.parallel_dims",
}


def reexport(upstream_source: str, module: str) -> str:
    """The fork's version of one of upstream's modules: ``from <module> import <its names>``."""
    tree = ast.parse(upstream_source)
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            names = [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    if not names:
        names = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")]
    body = "".join(f"    {n},\n" for n in names)
    return (f'"""A fork\'s module: re-exported from torchtitan_spmd (imports changed only)."""\n'
            f"from {module} import (  # noqa: F401\n{body})\n")


_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naif]+).*?grad_norm:\s*([-\d.naif]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _export(commit: str, dest: Path) -> None:
    """``git archive`` of ``commit`` into ``dest``, leaving out the blobs the mirror lacks."""
    dest.mkdir(parents=True)
    spec = ["--", "."] + [f":(exclude){p}" for p in MISSING]
    archive = subprocess.run(["git", f"--git-dir={MIRROR}", "archive", commit, *spec],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def setup(work: Path, commit: str) -> None:
    """Export upstream's tree twice (unmodified, library) and write the data stand-in into both."""
    unmodified, library = work / "unmodified", work / "library"
    for tree in (unmodified, library):
        if tree.exists():
            shutil.rmtree(tree)
    _export(commit, unmodified)
    data = unmodified / "tests" / "assets" / "c4_test" / "data.json"
    data.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(STANDIN), str(data)], check=True)
    shutil.copytree(unmodified, library, symlinks=True)
    for path, module in SWITCHED.items():
        (library / path).write_text(reexport((unmodified / path).read_text(), module))
    print(f"{unmodified}\n{library}")


def _cpu_patches() -> None:
    """The CPU launch patches (module docstring, 1-5); applied in every rank before upstream's trainer."""
    import types

    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    cpu = torch.cpu
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    defaults = {
        "get_device_name": lambda device=None: "cpu",
        "get_device_properties": lambda device=None: types.SimpleNamespace(name="cpu", total_memory=total),
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
        "memory_stats": lambda device=None: {},
    }
    for name, fn in defaults.items():
        if not hasattr(cpu, name):
            setattr(cpu, name, fn)

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    divide_factors = collectives._get_gradient_divide_factors

    def sum_only(*args, **kwargs):
        kwargs["force_sum_reduction_for_comms"] = True
        return divide_factors(*args[:5], **kwargs)

    collectives._get_gradient_divide_factors = sum_only

    import torchtitan.distributed.utils as dist_utils

    def set_pg_timeouts(timeout, parallel_dims):
        torch.distributed.barrier()
        groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
        for group in groups:
            torch.distributed.set_timeout(timeout, group)

    dist_utils.set_pg_timeouts = set_pg_timeouts

    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    from torchtitan.models.common import attention

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def sdpa(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
             return_aux=None, kernel_options=None):
        if score_mod is not None:
            raise NotImplementedError("the CPU attention stand-in takes no score_mod")
        ql, kl, vl = local(q), local(k), local(v)
        mask = None
        if block_mask is not None:
            q_len, kv_len = block_mask.seq_lengths
            mask = create_mask(block_mask.mask_mod, block_mask.kv_num_blocks.shape[0], 1, q_len, kv_len,
                               device=ql.device)
        out = F.scaled_dot_product_attention(ql, kl, vl, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        lse = None
        if return_aux is not None and getattr(return_aux, "lse", False):
            s = (ql @ kl.transpose(-2, -1)) * (scale if scale is not None else ql.shape[-1] ** -0.5)
            lse = (s if mask is None else s.masked_fill(~mask, float("-inf"))).logsumexp(-1)
        if isinstance(q, DTensor):
            out = DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)
            if lse is not None:
                lse = DTensor.from_local(lse, q.device_mesh, q.placements, run_check=False)
        return out, types.SimpleNamespace(lse=lse, max_scores=None)

    attention.FlexAttention._compiled_flex_attn = staticmethod(sdpa)
    attention._compiled_create_block_mask = create_block_mask
    set_determinism = dist_utils.set_determinism

    def set_determinism_keep_sdpa(*args, **kwargs):
        result = set_determinism(*args, **kwargs)
        attention.FlexAttention._compiled_flex_attn = staticmethod(sdpa)
        return result

    dist_utils.set_determinism = set_determinism_keep_sdpa


def _worker(argv: list[str]) -> None:
    """One rank: the CPU patches, then upstream's ``torchtitan.train`` as ``__main__``."""
    import runpy

    sys.argv = ["torchtitan.train", *argv]  # first: a0c831c49's ConfigManager binds sys.argv[1:] at import
    _cpu_patches()
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


def job_args(backend: str, dp: int, tp: int, pp: int, steps: int, dump: Path, june: bool = False) -> list[str]:
    """The trainer's command line for one job (module docstring); ``june``: a0c831c49's spellings."""
    batch = (["--training.local_batch_size", "4", "--training.seq_len", "256"] if june else
             ["--training.num_tokens_per_microbatch_per_dp_rank", "1024", "--training.max_context_length", "256"])
    args = ["--module", "llama3", "--config", "llama3_debugmodel",
            "--parallelism.spmd_backend", backend,
            "--parallelism.data_parallel_shard_degree", str(dp),
            "--parallelism.tensor_parallel_degree", str(tp),
            "--training.steps", str(steps), *batch,
            "--training.mixed_precision_param", "float32",
            "--debug.seed", "42", "--debug.deterministic",
            "--dump_folder", str(dump)]
    if pp > 1:  # upstream's debug config's Interleaved1F1B; CUDA graphs refuse PP (a config check)
        args += ["--parallelism.pipeline_parallel_degree", str(pp), "--parallelism.num_pp_microbatches", str(pp),
                 "--training.disable_cuda_graphs"]
    if june:  # a0c831c49: a section, not a policy union
        return [*args, "--activation_checkpoint.mode", "none"]
    return [*args, "activation_checkpoint:none"]  # a tyro subcommand: the options after it are its own


def run(work: Path, tree: str, backend: str, dp: int, tp: int, pp: int, steps: int, deps: str | None,
        spmd_types: str | None, extra: list[str], timeout: float) -> tuple[list[tuple[int, str, str]], Path]:
    """Run one job on one tree; return rank 0's ``(step, loss, grad_norm)`` lines and the log."""
    root = work / tree
    tag = f"{tree}_{backend}_dp{dp}_tp{tp}_pp{pp}" + ("_spmd023" if spmd_types else "")
    log = work / "logs" / f"{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    path = [p for p in (spmd_types, str(root), deps) if p]
    if tree == "library":
        path.insert(1 if spmd_types else 0, str(HERE))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env.pop("TORCHTITAN_SPMD_SURFACE", None)
    june = (root / "torchtitan" / "config" / "configs.py").read_text().count("ActivationCheckpointConfig") > 0
    if tree == "library":
        env["TORCHTITAN_SPMD_SURFACE"] = "june" if june else "august"
    nproc = dp * tp * pp
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--local-ranks-filter", str(nproc - 1 if pp > 1 else 0), str(Path(__file__).resolve()), "_worker",
           *job_args(backend, dp, tp, pp, steps, work / "dump" / tag, june), *extra]
    with open(log, "w") as out:
        try:
            subprocess.run(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            out.write("\n[upstream_trainer_august] timed out\n")
    text = _ANSI.sub("", log.read_text(errors="replace"))
    steps_seen = [(int(m[1]), m[2], m[3]) for m in _STEP.finditer(text)]
    return steps_seen, log


JOBS = [("partial_dtensor", 2, 1, 1), ("partial_dtensor", 1, 2, 1), ("spmd_types", 2, 1, 1),
        ("spmd_types", 1, 2, 1)]


def main() -> int:
    """Command line (module docstring)."""
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        _worker(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("setup", "run", "table"))
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK)
    parser.add_argument("--commit", default="b5bcd76")
    parser.add_argument("--tree", choices=("unmodified", "library"), default="library")
    parser.add_argument("--backend", default="spmd_types")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--deps", help="folder with grain and einops (pip install --target)")
    parser.add_argument("--spmd-types", help="folder with another spmd_types (pip install --target)")
    parser.add_argument("--jobs", nargs="*", help="BACKEND:DP:TP:PP for `table` (default: FSDP 2, TP 2 each)")
    parser.add_argument("--timeout", type=float, default=900)
    args, extra = parser.parse_known_args()
    if args.command == "setup":
        setup(args.work, args.commit)
        return 0
    jobs = JOBS if args.command == "table" and not args.jobs else (
        [tuple([j.split(":")[0], *map(int, j.split(":")[1:])]) for j in args.jobs] if args.jobs
        else [(args.backend, args.dp, args.tp, args.pp)])
    rows: dict[str, dict[int, str]] = {}
    for backend, dp, tp, pp in jobs:
        for tree in ("unmodified", "library") if args.command == "table" else (args.tree,):
            seen, log = run(args.work, tree, backend, dp, tp, pp, args.steps, args.deps, args.spmd_types, extra,
                            args.timeout)
            col = f"{tree}, `{backend}` dp {dp} tp {tp}" + (f" pp {pp}" if pp > 1 else "")
            rows[col] = {s: f"{loss} / {norm}" for s, loss, norm in seen}
            print(f"{col}: {len(seen)} steps ({log})", flush=True)
            if not seen:
                print(log.read_text(errors="replace")[-3000:])
    cols = list(rows)
    print("| step | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for step in range(1, args.steps + 1):
        print(f"| {step} | " + " | ".join(rows[c].get(step, "-") for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
