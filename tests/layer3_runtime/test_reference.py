"""The independent parity reference (:mod:`torchtitan_spmd.reference`), checked on its own.

The parity tests compare the trainer with it; these check it cheaply and directly: its
schedule and the trainer's against hand-derived values, its model against the project's
on the same weights (two independent statements of the same math), and that it imports
nothing of the trainer's runtime.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from torchtitan_spmd import reference
from torchtitan_spmd.config import LRSchedulerConfig
from torchtitan_spmd.data import Tokenizer
from torchtitan_spmd.models import get_model_spec
from torchtitan_spmd.tools.lr_scheduler import WarmupStableDecay

# warmup 2, 10 steps, min_lr_factor 0.1, cosine (upstream's schedule with no decay_ratio): warmup
# (s + 1) / 2, then the decay over the 8 remaining steps, one virtual step added to the stable
# phase (10 + 1 - 2 - 8 = 1 step at the peak): at 0-based step s >= 3 the progress is (s - 2) / 8
# and the factor 0.1 + 0.45 * (1 + cos(pi * (s - 2) / 8)).
_HAND = {0: 0.5, 1: 1.0, 2: 1.0, 4: 0.1 + 0.45 * (1 + math.sqrt(0.5)), 6: 0.55,
         8: 0.1 + 0.45 * (1 - math.sqrt(0.5)), 9: 0.1 + 0.45 * (1 + math.cos(math.pi * 7 / 8))}


@pytest.mark.parametrize("schedule", ["reference", "trainer"])
def test_the_schedule_is_warmup_then_cosine_decay(schedule: str) -> None:
    if schedule == "reference":
        def factor(s: int) -> float:
            return reference.lr_factor(s, warmup_steps=2, total_steps=10, min_lr_factor=0.1, decay_type="cosine")
    else:
        factor = WarmupStableDecay.from_config(
            LRSchedulerConfig(warmup_steps=2, min_lr_factor=0.1, decay_type="cosine"), 10)
    for step, want in _HAND.items():
        assert factor(step) == pytest.approx(want, abs=1e-12), (step, factor(step), want)
    decay = [factor(s) for s in range(2, 10)]
    assert all(a > b for a, b in zip(decay[1:], decay[2:], strict=False)), decay  # it decays, never rises


@pytest.mark.parametrize("model", ["llama3", "qwen3"])
def test_the_restated_model_matches_the_projects_on_the_same_weights(model: str) -> None:
    spec = get_model_spec(model)
    vocab = Tokenizer().vocab_size
    net = spec.build_initialized("tiny", seed=3, vocab_size=vocab)
    weights = {k: v.double() for k, v in reference.initial_weights(model, "tiny", 3, vocab).items()}
    arch = reference.architecture(type("Cfg", (), {"model": type("M", (), {"name": model})})(),
                                  spec.model_config("tiny", vocab_size=vocab))
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    want = reference.forward(weights, tokens, arch)
    with torch.no_grad():
        got = net(tokens).double()
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
    # ... and the comparison can fail: the other RoPE pairing is far off.
    other = reference.Architecture(rope="half" if arch.rope == "interleaved" else "interleaved",
                                   qk_norm=arch.qk_norm, head_dim=arch.head_dim, norm_eps=arch.norm_eps,
                                   rope_theta=arch.rope_theta)
    assert (reference.forward(weights, tokens, other) - want).abs().max().item() > 1e-3


def test_the_reference_shares_no_runtime_code_with_the_trainer() -> None:
    """Its only project imports are data: the initial weights, the batches, the vocab size."""
    tree = ast.parse(Path(reference.__file__).read_text())
    allowed = {
        "initial_weights": {"torchtitan_spmd.models": {"get_model_spec"}},
        "global_batches": {"torchtitan_spmd.data": {"build_dataloader"}},
        "run_reference": {"torchtitan_spmd.data": {"build_tokenizer"}, "torchtitan_spmd.models": {"get_model_spec"}},
        # not numerics: the restricted reader, so that the reference runs no code from a checkpoint either
        "checkpoint_weights": {"torchtitan_spmd.checkpoint.safe_metadata": {
            "RefusedCheckpointData", "RestrictedLoadPlanner", "RestrictedReader"}},
    }
    seen: dict[str, dict[str, set[str]]] = {}
    for node in tree.body:
        if isinstance(node, ast.If):  # the TYPE_CHECKING block: annotations only
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            assert not (mod or "").startswith("torchtitan_spmd"), ast.unparse(node)
        if isinstance(node, ast.FunctionDef):
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and (sub.module or "").startswith("torchtitan_spmd"):
                    seen.setdefault(node.name, {}).setdefault(sub.module, set()).update(a.name for a in sub.names)
                elif isinstance(sub, ast.Import):
                    assert not any(a.name.startswith("torchtitan_spmd") for a in sub.names), ast.unparse(sub)
    assert seen == allowed


def test_the_restated_tied_model_matches_the_projects() -> None:
    """A tied model (``enable_weight_tying``): the reference restates the logits from the embedding
    table (there is no ``output.weight``), as the project's model computes them."""
    import dataclasses

    spec = get_model_spec("llama3")
    vocab = Tokenizer().vocab_size
    config = dataclasses.replace(spec.model_config("tiny", vocab_size=vocab), enable_weight_tying=True)
    net = spec.build(config)
    net.init_weights(5)
    weights = {k: v.detach().double() for k, v in net.state_dict().items()}
    assert "output.weight" not in weights
    arch = reference.architecture(type("Cfg", (), {"model": type("M", (), {"name": "llama3"})})(), config)
    assert arch.tied
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    want = reference.forward(weights, tokens, arch)
    with torch.no_grad():
        got = net(tokens).double()
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
