"""Model converters (issue 42): upstream's names at both surfaces, float8 training (torchao) against
torchao's own single-process model, LoRA, and the one-line setup errors."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import pytest
import torch
from float8_helpers import (
    EP2,
    F8_TOL,
    MX_EXPERTS_SHARDED_TOL,
    check_float8_parity,
    check_lora,
    torchao_mxfp8,
)
from torch import nn

from torchtitan_spmd.config import ConfigManager
from torchtitan_spmd.config.converters import (
    Float8GroupedExpertsConverterConfig,
    Float8LinearConverterConfig,
    LoRAConverterConfig,
    MXFP8GroupedExpertsConverterConfig,
    MXFP8LinearConverterConfig,
    NVFP4LinearConverterConfig,
)
from torchtitan_spmd.techniques.converters import build_converters, convert_model

pytest.importorskip("torchao.float8", reason='float8 needs the float8 extra: pip install -e ".[float8]"')



def _fields(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return out


def test_upstream_import_paths_fields_and_defaults() -> None:
    from torchtitan_spmd.components.lora import LoRAConverter
    from torchtitan_spmd.components.quantization import (
        Float8GroupedExpertsConverter,
        Float8LinearConverter,
        MXFP8LinearConverter,
        NVFP4LinearConverter,
    )

    assert _fields(Float8LinearConverter.Config) == {
        "model_compile_enabled": False, "recipe_name": "rowwise", "filter_fqns": [], "emulate": False}
    assert _fields(LoRAConverter.Config) == {"rank": 8, "alpha": 16.0, "target_modules": None}
    assert _fields(MXFP8LinearConverter.Config) == {"model_compile_enabled": False, "fqns": [], "emulate": False}
    assert _fields(NVFP4LinearConverter.Config) == {"model_compile_enabled": False, "fqns": [], "emulate": False}
    assert _fields(Float8GroupedExpertsConverter.Config) == {"model_compile_enabled": False, "emulate": False}
    # upstream b5bcd76 exports the linears too
    from torchtitan_spmd.components.quantization import Float8Linear, MXFP8Linear, NVFP4Linear

    assert [c.__name__ for c in (Float8Linear, MXFP8Linear, NVFP4Linear)] == ["Float8Linear", "MXFP8Linear",
                                                                             "NVFP4Linear"]
    assert issubclass(NVFP4Linear, nn.Linear) and Float8Linear.__mro__[1].__module__.startswith("torchao.")
    # and its submodules, whose names upstream's recipes import
    from torchtitan_spmd.components.quantization.float8 import Float8GroupedExpertsConverter as F8E
    from torchtitan_spmd.components.quantization.float8 import Float8Linear as F8L
    from torchtitan_spmd.components.quantization.mx import MXFP8Linear as MXL
    from torchtitan_spmd.components.quantization.mx import MXFP8LinearConverter as MXC
    from torchtitan_spmd.components.quantization.nvfp4 import NVFP4Linear as NVL
    from torchtitan_spmd.components.quantization.nvfp4 import NVFP4LinearConverter as NVC
    from torchtitan_spmd.components.quantization.nvfp4 import nvfp4_bf16_tail_fqns

    assert (F8E, F8L, MXL, MXC, NVL, NVC) == (Float8GroupedExpertsConverter, Float8Linear, MXFP8Linear,
                                              MXFP8LinearConverter, NVFP4Linear, NVFP4LinearConverter)
    assert nvfp4_bf16_tail_fqns(6, 0.15) == [f"layers.{i}." for i in range(5)]
    assert nvfp4_bf16_tail_fqns(28, 0.15) == [f"layers.{i}." for i in range(23)]  # ceil(4.2) = 5 kept
    assert nvfp4_bf16_tail_fqns(4, 0.0) == [f"layers.{i}." for i in range(4)]
    for args, words in (((4, 1.0), "nothing to convert"), ((0, 0.15), "num_layers"), ((4, 1.5), "a number in")):
        with pytest.raises(ValueError, match=words):
            nvfp4_bf16_tail_fqns(*args)


# recipe -> (module, flavour, converter class names), as upstream's recipes list them
RECIPES = {
    "llama3_debugmodel_float8": ("llama3", "debugmodel", ["Float8LinearConverter"]),
    "llama3_debugmodel_float8_emulate_lora": ("llama3", "debugmodel", ["Float8LinearConverter", "LoRAConverter"]),
    "llama3_debugmodel_nvfp4": ("llama3", "debugmodel", ["NVFP4LinearConverter"]),
    "llama3_debugmodel_first_85_pct_layers_nvfp4": ("llama3", "debugmodel", ["NVFP4LinearConverter"]),
    "llama3_8b_mxfp8": ("llama3", "8B", ["MXFP8LinearConverter"]),
    "llama3_8b_first_85_pct_layers_nvfp4": ("llama3", "8B", ["NVFP4LinearConverter"]),
    "llama3_405b": ("llama3", "405B", ["Float8LinearConverter"]),
    "deepseek_v3_671b_float8": ("deepseek_v3", "671B", ["Float8LinearConverter", "Float8GroupedExpertsConverter"]),
    "deepseek_v3_debugmodel_mxfp8": ("deepseek_v3", "debugmodel", ["MXFP8LinearConverter",
                                                                   "MXFP8GroupedExpertsConverter"]),
    "qwen3_debugmodel_nvfp4": ("qwen3", "debugmodel", ["NVFP4LinearConverter"]),
    "qwen3_debugmodel_first_85_pct_layers_nvfp4": ("qwen3", "debugmodel", ["NVFP4LinearConverter"]),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_upstream_converter_recipes(recipe: str) -> None:
    module, flavor, names = RECIPES[recipe]
    job = ConfigManager().parse_args(["--module", module, "--config", recipe])
    assert (job.model.name, job.model.flavor) == (module, flavor)
    assert [c.converter for c in job.model.converters] == names
    lora = job.model.converters[-1]
    if "first_85_pct_layers" in recipe:  # upstream's mix: the last ceil(15 %) blocks and the output stay
        from torchtitan_spmd.models import get_model_spec

        n_layers = get_model_spec(module).model_config(flavor).n_layers
        keep = n_layers - -(-n_layers * 15 // 100)
        assert job.model.converters[0].fqns == [f"layers.{i}." for i in range(keep)], (n_layers, keep)
    if recipe == "llama3_debugmodel_float8_emulate_lora":
        assert (job.model.converters[0].emulate, lora.rank, lora.alpha, lora.target_modules) == (
            True, 8, 16.0, ["wq", "wkv", "wo"])


def test_a_forks_job_names_upstreams_converters_unchanged() -> None:
    """Upstream's recipe text, with only the package prefix changed."""
    from torchtitan_spmd.components.lora import LoRAConverter
    from torchtitan_spmd.components.quantization import Float8LinearConverter
    from torchtitan_spmd.models.llama3 import model_registry
    from torchtitan_spmd.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.model_spec = model_registry("debugmodel", converters=[
        Float8LinearConverter.Config(emulate=True, model_compile_enabled=False),
        LoRAConverter.Config(rank=8, alpha=16.0, target_modules=["wq", "wkv", "wo"]),
    ])
    assert config.model_spec.flavor == "debugmodel" and len(config.model_spec.converters) == 2
    assert config.model.converters == list(config.model_spec.converters)
    with pytest.raises(ValueError, match=r"must be applied before LoRAConverter"):
        model_registry("debugmodel", converters=[LoRAConverter.Config(), Float8LinearConverter.Config()])


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


def test_without_torchao_float8_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    with pytest.raises(ImportError) as err:
        build_converters([Float8LinearConverterConfig(emulate=True)])
    assert 'pip install -e ".[float8]"' in _one_line(err.value)


@pytest.mark.parametrize(("config", "capability"), [
    ("Float8LinearConverter", "SM89"),  # not emulated
    ("Float8GroupedExpertsConverter", "SM89"),
    ("MXFP8LinearConverter", "SM100"),
    ("MXFP8GroupedExpertsConverter", "SM100"),
    ("NVFP4LinearConverter", "SM100"),
])
def test_hardware_converters_are_one_line_naming_the_capability(config: str, capability: str) -> None:
    from torchtitan_spmd.config.converters import CONVERTER_CONFIGS

    if torch.cuda.is_available():
        pytest.skip("the capability errors are for machines without the GPU")
    with pytest.raises(ValueError) as err:
        build_converters([CONVERTER_CONFIGS[config]()])
    assert capability in _one_line(err.value) and config in str(err.value)


def test_compiled_rowwise_float8_has_inductor_round_casts_as_eager() -> None:
    """Upstream's workaround for pytorch/pytorch#150859, where a compiled rowwise float8 run needs it
    (the GPU's path; built here as the dry run builds it), and nowhere else. (torch's own ``patch``
    restores the flag: pytest's monkeypatch deletes a config module's entry on undo.)"""
    import torch._inductor.config as inductor_config

    from torchtitan_spmd.techniques.quantization import hardware_checks_off

    with inductor_config.patch(emulate_precision_casts=False):
        build_converters([Float8LinearConverterConfig(emulate=True)])
        with hardware_checks_off():
            build_converters([Float8LinearConverterConfig(recipe_name="rowwise_with_gw_hp",
                                                          model_compile_enabled=True)])
        assert inductor_config.emulate_precision_casts is False
        with hardware_checks_off():
            build_converters([Float8LinearConverterConfig(model_compile_enabled=True)])
        assert inductor_config.emulate_precision_casts is True
    assert inductor_config.emulate_precision_casts is False  # torch's default, restored


def test_a_hardware_recipe_stops_at_setup(tmp_path: Any) -> None:
    from torchtitan_spmd.train import validate_job

    if torch.cuda.is_available():
        pytest.skip("the capability errors are for machines without the GPU")
    job = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel_nvfp4"])
    with pytest.raises(ValueError, match="SM100"):
        validate_job(job, 1, "cpu")


def _tiny() -> nn.Module:
    from torchtitan_spmd.models import get_model_spec

    spec = get_model_spec("llama3")
    with torch.device("meta"):
        return spec.build(spec.model_config("tiny"))


def _kinds(model: nn.Module) -> dict[str, str]:
    return {fqn: type(m).__name__ for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_filter_fqns_and_upstream_names() -> None:
    model = _tiny()
    done = convert_model(model, build_converters([
        Float8LinearConverterConfig(emulate=True, filter_fqns=["lm_head", "w2"]),  # lm_head: upstream's output
        LoRAConverterConfig(rank=4, target_modules=["wkv"]),  # upstream's fused wk + wv
    ]))
    kinds = _kinds(model)
    assert kinds["output"] == "Linear" and kinds["layers.0.feed_forward.w2"] == "Linear"
    assert kinds["layers.1.feed_forward.w1"] == "Float8Linear"
    assert kinds["layers.0.attention.wk"] == kinds["layers.1.attention.wv"] == "LoRAFloat8Linear"
    assert kinds["layers.0.attention.wq"] == "Float8Linear"
    assert len(done["Float8LinearConverter"]) == 12 and len(done["LoRAConverter"]) == 4
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_a", "lora_b")) for n in trainable)
    with pytest.raises(ValueError, match=r"\['wqkv'\] name no linear"):
        convert_model(_tiny(), build_converters([LoRAConverterConfig(target_modules=["wqkv"])]))


# ----------------------------------------------------------------------------- float8 parity
PP2_FSDP2 = {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2}
CELLS: dict[str, tuple[str, tuple[str, ...], dict[str, Any] | None, int, str]] = {
    # id: (backend, filter_fqns (also the judge's unconverted linears), parallelism (None: FSDP 2 x TP 2),
    #      rows a forward: a pipeline microbatch has its own scales, activation_checkpoint.mode)
    "default-fsdp2_tp2": ("default", (), None, 2, "none"),
    "full_dtensor-fsdp2_tp2-filter_output": ("full_dtensor", ("output",), None, 2, "none"),
    "default-pp2_fsdp2": ("default", (), PP2_FSDP2, 1, "none"),
    # full AC recomputes each block's float8 forward, scales included (spmd_types: layer 4, selective AC)
    "full_dtensor-pp2_fsdp2-ac_full": ("full_dtensor", (), PP2_FSDP2, 1, "full"),
    # HSDP: four data-parallel ranks, each scaling its own rows
    "default-hsdp2x2": ("default", (), {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2}, 2,
                        "none"),
    # CP: each rank's matmuls scale its own tokens (headtail chunks), as data parallelism's do; the
    # judge runs each linear on each CP rank's tokens on their own
    "full_dtensor-cp2_tp2": ("full_dtensor", (), {"context_parallel_degree": 2, "tensor_parallel_degree": 2}, 2,
                             "none"),
    "full_dtensor-fsdp2_cp2": ("full_dtensor", (), {"data_parallel_shard_degree": 2, "context_parallel_degree": 2},
                               2, "none"),
}


@pytest.mark.parametrize("cell", list(CELLS))
def test_float8_matches_torchaos_single_process_model(cell: str) -> None:
    backend, skip, parallelism, rows, ac = CELLS[cell]
    check_float8_parity(cell, backend, skip, parallelism, rows, ac=ac)


@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_float8_dense_layers_under_expert_parallelism_match_torchaos_model(backend: str) -> None:
    """The tiny MoE (qwen3 ``moe_tiny``) under EP 2: its dense linears float8 (rowwise, emulated),
    its experts' tokens exchanged over ``ep`` in high precision, against torchao's own model of the
    same MoE on one process, both routing round-robin (float8 with top-k routing is chaotic:
    ``float8_helpers.MODELS``). spmd_types: layer 4."""
    check_float8_parity(f"{backend}-fsdp2_tp2_ep2-moe", backend, (), EP2, model="qwen3")


def test_float8_scales_on_shards_are_the_unsharded_ones() -> None:
    """Under TP every scale a sharded float8 matmul uses is the one torchao's single-process model
    computes for the same operand: equal where the scaled rows are whole on the rank, this rank's
    slice where the scales themselves are split by the shard (e.g. a column-wise weight's per-column
    scales). rowwise rounds scales to powers of two, so the losses hardly show a scale taken over a
    local shard (measured: 1e-7, as the right one); the scales do."""
    from float8_helpers import float8_job, run_trainer, torchao_scales

    outs, _ = run_trainer(float8_job("default", [Float8LinearConverterConfig(emulate=True)], steps=1),
                          probe="float8_helpers:scale_probe")
    want = torchao_scales("rowwise")
    checked = sliced = 0
    for out in outs[:2]:  # data-parallel rank 0's two tensor-parallel ranks
        got, tp_rank = out["probe"]["calls"], out["probe"]["tp_rank"]
        assert len(got) == len(want) == 90, (len(got), len(want))
        for i, ((role, values, shape), (want_role, want_values, want_shape)) in enumerate(zip(got, want, strict=True)):
            assert role == want_role, (i, role, want_role)
            full = torch.tensor(want_values).reshape(want_shape)
            if shape != want_shape:  # split by the shard: this rank's part
                dim = next(d for d, (a, b) in enumerate(zip(shape, want_shape, strict=True)) if a != b)
                full = full.narrow(dim, tp_rank * shape[dim], shape[dim])
                sliced += 1
            mine = torch.tensor(values).reshape(shape)
            bad = (~torch.isclose(mine, full, rtol=1e-6, atol=0)).sum()
            assert bad == 0, f"cast {i} ({role}, shape {shape}): {int(bad)} of {mine.numel()} scales differ"
            checked += 1
    assert checked == 180 and sliced > 0


# ----------------------------------------------------------------------------- MXFP8
def test_mxfp8_converts_the_linears_it_can_and_names_the_ones_it_cannot() -> None:
    """Every linear whose dimensions are multiples of 32 when ``fqns`` is empty (the MoE's router,
    8 outputs, stays); only the named ones otherwise; a named linear MXFP8 cannot take, or a name
    that matches nothing, is one line at setup; the dry run's counts see them."""
    from torchtitan_spmd.models import get_model_spec
    from torchtitan_spmd.techniques.converters import converted_counts

    model = _tiny()
    done = convert_model(model, build_converters([MXFP8LinearConverterConfig(emulate=True)]))
    assert len(done["MXFP8LinearConverter"]) == 15 and set(_kinds(model).values()) == {"MXFP8Linear"}
    counts = converted_counts(model)
    assert counts["mxfp8_linears"] == 15
    assert counts["mxfp8_weight_numel"] == sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))

    model = _tiny()
    convert_model(model, build_converters([MXFP8LinearConverterConfig(emulate=True, fqns=["wq", "lm_head"])]))
    kinds = _kinds(model)
    assert sorted(k for k, v in kinds.items() if v == "MXFP8Linear") == [
        "layers.0.attention.wq", "layers.1.attention.wq", "output"]

    spec = get_model_spec("qwen3")
    with torch.device("meta"):
        moe = spec.build(spec.model_config("moe_tiny"))
    done = convert_model(moe, build_converters([MXFP8LinearConverterConfig(emulate=True)]))
    assert not any("router" in fqn or "gate" in fqn for fqn in done["MXFP8LinearConverter"]), done
    _named_linears_errors(MXFP8LinearConverterConfig, 32, Float8LinearConverterConfig(emulate=True), "Float8Linear")


def _named_linears_errors(config: Any, multiple: int, other: Any, other_class: str) -> None:
    """A converter of named linears (``config``, emulated), each error one line: naming a linear whose
    dimensions are no multiple of ``multiple`` (the tiny MoE's router, 8 outputs), naming nothing,
    naming a linear ``other`` already converted to ``other_class``, and emulate with compile."""
    from torchtitan_spmd.models import get_model_spec

    spec = get_model_spec("qwen3")
    with torch.device("meta"):
        moe = spec.build(spec.model_config("moe_tiny"))
    router = next(fqn for fqn, m in moe.named_modules() if type(m) is nn.Linear and m.out_features % multiple)
    with pytest.raises(ValueError) as err:
        convert_model(moe, build_converters([config(emulate=True, fqns=[router])]))
    assert f"names {router!r}" in _one_line(err.value) and f"multiples of {multiple}" in str(err.value)
    with pytest.raises(ValueError, match=r"\['wqkv'\] name no linear"):
        convert_model(_tiny(), build_converters([config(emulate=True, fqns=["wqkv"])]))
    with pytest.raises(ValueError, match=f"already a {other_class}"):
        convert_model(_tiny(), build_converters([other, config(emulate=True, fqns=["wq"])]))
    with pytest.raises(ValueError) as err:
        build_converters([config(emulate=True, model_compile_enabled=True)])
    assert "emulate=True is for eager mode" in _one_line(err.value)


def test_mxfp8_matches_torchao_on_one_process_and_stops_on_a_partial_block() -> None:
    """One process: the converted tiny Llama's loss and every gradient equal torchao's own
    ``MXFP8Linear`` model's bit for bit, and differ from high precision. A forward whose tokens
    are no multiple of 32 is one line naming the fields to change."""
    from torchtitan_spmd.models import get_model_spec

    spec = get_model_spec("llama3")
    ours, judge, plain = (spec.build_initialized("tiny", seed=0, vocab_size=320, max_seq_len=64) for _ in range(3))
    convert_model(ours, build_converters([MXFP8LinearConverterConfig(emulate=True)]))
    assert torchao_mxfp8(judge, ()) == 15
    tokens = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    grads = []
    for model in (ours, judge, plain):
        loss = model(tokens).pow(2).mean()
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name
    assert not torch.allclose(grads[0]["output.weight"], grads[2]["output.weight"], rtol=1e-4, atol=0)
    with pytest.raises(ValueError) as err:
        ours(tokens[:1, :16])
    assert "has 16 tokens, not a multiple of 32" in _one_line(err.value)
    assert "training.local_batch_size" in str(err.value)


def test_lora_over_mxfp8_trains_only_the_adapters() -> None:
    """LoRA after MXFP8 (as after float8): the targeted linears become ``LoRAMXFP8Linear``, and a
    step's gradients reach the adapters alone."""
    from torchtitan_spmd.models import get_model_spec

    model = get_model_spec("llama3").build_initialized("tiny", seed=0, vocab_size=320, max_seq_len=64)
    convert_model(model, build_converters([MXFP8LinearConverterConfig(emulate=True),
                                           LoRAConverterConfig(rank=4, target_modules=["wq", "wo"])]))
    kinds = _kinds(model)
    assert kinds["layers.1.attention.wo"] == "LoRAMXFP8Linear" and kinds["layers.1.attention.wk"] == "MXFP8Linear"
    with torch.no_grad():  # the adapters as the trainer initialises them (converted after the base here)
        for fqn, module in model.named_modules():
            if kinds.get(fqn) == "LoRAMXFP8Linear":
                module.lora_a.copy_(model.initial_value(f"{fqn}.lora_a", tuple(module.lora_a.shape), 0))
                module.lora_b.zero_()
    model(torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))).pow(2).mean().backward()
    with_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    assert len(with_grad) == 8 and all(n.endswith(("lora_a", "lora_b")) for n in with_grad), with_grad
    assert all(model.get_submodule(n.rpartition(".")[0]).get_parameter(n.rpartition(".")[2]).grad.abs().sum() > 0
               for n in with_grad if n.endswith("lora_b"))


def test_mxfp8_tensor_parallelism_splitting_a_block_is_one_line_naming_the_linears() -> None:
    """``wk``'s 32 outputs over tp 2 would put 16 of a block on each rank: a setup error naming it."""
    from types import SimpleNamespace

    from torchtitan_spmd.techniques.quantization import bind_mxfp8_shards

    model = _tiny()
    convert_model(model, build_converters([MXFP8LinearConverterConfig(emulate=True)]))

    def col(dim: int) -> Any:
        return SimpleNamespace(layout=SimpleNamespace(shard_dims=lambda: {"tp": dim}))

    layouts = {f"{fqn}.weight": col(1 if fqn.endswith(("wo", "w2")) else 0)
               for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert bind_mxfp8_shards(model, layouts, 1) == 0  # no tensor parallelism: nothing to split
    with pytest.raises(ValueError) as err:
        bind_mxfp8_shards(model, layouts, 2)
    text = _one_line(err.value)
    assert "layers.0.attention.wk (32 / tp 2 = 16)" in text and "layers.1.attention.wv" in text
    assert "attention.wq" not in text and "w2" not in text
    ok = {k: v for k, v in layouts.items() if not k.endswith(("wk.weight", "wv.weight"))}
    assert bind_mxfp8_shards(model, ok, 2) == 11
    assert model.get_submodule("layers.0.attention.wo").tp_weight_shard_dim == 1


#: cell -> (backend, linears left in high precision (tp 2 would split ``wk``'s and ``wv``'s blocks),
#: parallelism (None: FSDP 2 x TP 2), rows a forward)
MX_CELLS: dict[str, tuple[str, tuple[str, ...], dict[str, Any] | None, int]] = {
    "default-fsdp2_tp2": ("default", ("wk", "wv"), None, 2),
    "full_dtensor-fsdp2_tp2": ("full_dtensor", ("wk", "wv"), None, 2),
    # one row a microbatch: 32 tokens, one block along the tokens
    "default-pp2_fsdp2": ("default", (), PP2_FSDP2, 1),
    # each CP rank's 32 tokens (headtail chunks); the judge's linears see each rank's on their own
    "full_dtensor-cp2_tp2": ("full_dtensor", ("wk", "wv"), {"context_parallel_degree": 2,
                                                            "tensor_parallel_degree": 2}, 2),
}


@pytest.mark.parametrize("cell", list(MX_CELLS))
def test_mxfp8_matches_torchaos_single_process_model(cell: str) -> None:
    """MXFP8 emulated against torchao's own ``MXFP8Linear`` model on one process: no block spans a
    shard, so every scale is the unsharded one with nothing reduced. spmd_types: layer 4,
    type-checked."""
    backend, skip, parallelism, rows = MX_CELLS[cell]
    check_float8_parity(f"{cell}-mxfp8", backend, skip, parallelism, rows, recipe="mxfp8")


# ----------------------------------------------------------------------------- LoRA
# LoRA alone under default; upstream's float8 + LoRA recipe's converters under full_dtensor (and,
# type-checked, under spmd_types: layer 4's test_converters_spmd.py)
@pytest.mark.parametrize(("backend", "float8"), [("default", False), ("full_dtensor", True)])
def test_lora_trains_only_the_adapters_and_exports_merged(tmp_path: Any, backend: str, float8: bool) -> None:
    check_lora(tmp_path, backend, float8=float8)


def test_lora_under_pipeline_parallelism_matches_peft(tmp_path: Any) -> None:
    """PP 2 x FSDP 2 (1F1B): each stage trains its own blocks' adapters, the frozen base on both
    stages stays bit-identical, the adapters match peft's, and the merged export (written by
    both stages) equals the LoRA model's logits."""
    check_lora(tmp_path, "default", parallelism=PP2_FSDP2)


# ----------------------------------------------------------------------------- MXFP8 grouped experts
def _moe_tiny() -> nn.Module:
    from torchtitan_spmd.models import get_model_spec

    spec = get_model_spec("qwen3")
    with torch.device("meta"):
        return spec.build(spec.model_config("moe_tiny"))


@pytest.mark.parametrize(("config", "prefix", "multiple"), [
    (MXFP8GroupedExpertsConverterConfig, "MXFP8", 32), (Float8GroupedExpertsConverterConfig, "Float8", 16)])
def test_quantized_experts_convert_and_refuse_in_one_line(config: Any, prefix: str, multiple: int) -> None:
    from torchtitan_spmd.models.moe import GroupedExperts
    from torchtitan_spmd.techniques.converters import converted_counts

    name, kind = config.converter, prefix.lower()
    model = _moe_tiny()
    done = convert_model(model, build_converters([config(emulate=True)]))
    assert done == {name: ["layers.0.moe.experts", "layers.1.moe.experts"]}
    assert type(model.get_submodule("layers.1.moe.experts")).__name__ == f"{prefix}GroupedExperts"
    counts = converted_counts(model)
    assert counts[f"{kind}_experts"] == 2 and counts[f"{kind}_expert_weight_numel"] == 2 * 3 * 8 * 64 * 64
    assert {k for k in counts if k.endswith("_experts")} == {f"{kind}_experts"}
    with pytest.raises(ValueError) as err:
        convert_model(_tiny(), build_converters([config(emulate=True)]))
    assert f"{name}: the model has no MoE experts" in _one_line(err.value)
    with torch.device("meta"):
        narrow = nn.ModuleDict({"experts": GroupedExperts(64, multiple + 8, 2)})
    with pytest.raises(ValueError) as err:
        convert_model(narrow, build_converters([config(emulate=True)]))
    assert (f"experts has dim 64 and hidden dim {multiple + 8}; {prefix} grouped GEMMs need both multiples "
            f"of {multiple}") in _one_line(err.value)
    with pytest.raises(ValueError) as err:
        build_converters([config(emulate=True, model_compile_enabled=True)])
    assert "emulate=True is for eager mode" in _one_line(err.value)


def test_mxfp8_experts_fields_are_checked_in_one_line() -> None:
    from torchtitan_spmd.config.converters import check_converters

    for bad, text in ((MXFP8GroupedExpertsConverterConfig(pad_multiple=48), "pad_multiple: expected a positive "
                       "multiple of 32"),
                      (MXFP8GroupedExpertsConverterConfig(recipe_name="mxfp8_floor"), "recipe_name: invalid value")):
        with pytest.raises(ValueError) as err:
            check_converters([bad])
        assert text in _one_line(err.value)


def test_mxfp8_experts_pad_each_group_apart() -> None:
    from torchtitan_spmd.techniques.quantization import _padded_positions

    where, padded = _padded_positions(torch.tensor([5, 0, 40, 19]), 32)
    assert padded.tolist() == [32, 0, 64, 32]
    assert where.tolist() == list(range(5)) + list(range(32, 72)) + list(range(96, 115))


@pytest.mark.parametrize(("config", "judge"), [
    (MXFP8GroupedExpertsConverterConfig, "torchao_mxfp8_experts"),
    (Float8GroupedExpertsConverterConfig, "torchao_float8_experts")], ids=["mxfp8", "float8"])
def test_quantized_experts_match_torchao_on_one_process(config: Any, judge: str) -> None:
    """The converted tiny MoE's loss and every gradient equal, bit for bit, those of the same MoE
    whose experts call torchao: MXFP8, its own ``_quantize_then_scaled_grouped_mm`` (torchao
    padding the groups); float8, a loop over its own float8 linear matmul (rowwise, emulated;
    products and gradients in bfloat16, as its grouped GEMM), torchao 0.18's float8 grouped GEMM
    being Triton only. Both differ from high precision."""
    import float8_helpers

    from torchtitan_spmd.models import get_model_spec

    spec = get_model_spec("qwen3")
    ours, theirs, plain = (spec.build_initialized("moe_tiny", seed=0, vocab_size=320, max_seq_len=64)
                           for _ in range(3))
    convert_model(ours, build_converters([config(emulate=True)]))
    assert getattr(float8_helpers, judge)(theirs) == 2
    tokens = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    grads = []
    for model in (ours, theirs, plain):
        model(tokens).pow(2).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name
    w1 = "layers.0.moe.experts.w1"
    assert not torch.allclose(grads[0][w1], grads[2][w1], rtol=1e-3, atol=0)


def test_mxfp8_experts_tensor_parallelism_splitting_a_block_is_one_line() -> None:
    from types import SimpleNamespace

    from torchtitan_spmd.techniques.quantization import bind_mxfp8_shards

    model = _moe_tiny()
    convert_model(model, build_converters([MXFP8GroupedExpertsConverterConfig(emulate=True)]))
    layouts = {f"layers.{i}.moe.experts.w1": SimpleNamespace(layout=SimpleNamespace(shard_dims=lambda: {"tp": 1}))
               for i in range(2)}
    bind_mxfp8_shards(model, layouts, 2)  # hidden 64 / tp 2 = 32: whole blocks
    with pytest.raises(ValueError) as err:
        bind_mxfp8_shards(model, layouts, 4)
    assert "layers.0.moe.experts (hidden dim 64 / tp 4 = 16)" in _one_line(err.value)


#: cell -> (backend, parallelism, tolerance): the tiny MoE, experts in MXFP8 (emulated), routed
#: round-robin (``float8_helpers.MODELS``); the attention linears and the output in high precision.
MX_EXPERT_CELLS: dict[str, tuple[str, dict[str, Any], float]] = {
    "default-fsdp4": ("default", {"data_parallel_shard_degree": 4}, F8_TOL),
    "full_dtensor-fsdp4": ("full_dtensor", {"data_parallel_shard_degree": 4}, F8_TOL),
    "default-fsdp2_tp2": ("default", {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
                          MX_EXPERTS_SHARDED_TOL),
    "full_dtensor-fsdp2_tp2_ep2": ("full_dtensor", EP2, MX_EXPERTS_SHARDED_TOL),
}


@pytest.mark.parametrize("cell", list(MX_EXPERT_CELLS))
def test_mxfp8_experts_match_torchaos_single_process_model(cell: str) -> None:
    """Against the same MoE on one process whose experts call torchao's own MXFP8 grouped GEMM:
    exact where the experts are whole on each rank (FSDP), within bfloat16's rounding of partial
    products (TP) or other token blocks (EP) where they are sharded (``MX_EXPERTS_SHARDED_TOL``).
    spmd_types: layer 4, type-checked."""
    backend, parallelism, tol = MX_EXPERT_CELLS[cell]
    check_float8_parity(cell, backend, (), parallelism, model="qwen3", recipe="mxfp8_experts", tol=tol)


# ----------------------------------------------------------------------------- float8 grouped experts
def test_float8_experts_pad_each_group_to_16_for_the_gpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao's float8 grouped GEMM needs every expert's group a multiple of 16 rows (upstream pads
    in its token dispatcher): uneven groups reach each GEMM padded with zero rows, and the rows
    come back in their order, equal to the unpadded per-expert matmuls'."""
    from float8_helpers import torchao_float8_matmul

    from torchtitan_spmd.models.moe import GroupedExperts
    from torchtitan_spmd.techniques import quantization

    experts = nn.ModuleDict({"experts": GroupedExperts(32, 32, 3)})
    convert_model(experts, build_converters([Float8GroupedExpertsConverterConfig(emulate=True)]))
    module = experts["experts"]
    with torch.no_grad():
        for w in (module.w1, module.w2, module.w3):
            w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
    seen: list[tuple[list[int], int]] = []
    real = quantization._GroupedFloat8Matmul.apply

    def spy(a: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor, *rest: Any) -> torch.Tensor:
        seen.append((offs.tolist(), a.shape[0]))
        return real(a, weight_t, offs, *rest)

    monkeypatch.setattr(quantization._GroupedFloat8Matmul, "apply", spy)
    x = torch.randn(5 + 0 + 19, 32, generator=torch.Generator().manual_seed(2))
    out = module.expert_outputs(x, torch.tensor([5, 0, 19]))
    assert seen == [([16, 16, 48], 48)] * 3
    mm = torchao_float8_matmul()
    want = torch.cat([mm(torch.nn.functional.silu(mm(r, module.w1[e])) * mm(r, module.w3[e]), module.w2[e])
                      for e, r in ((0, x[:5]), (2, x[5:]))])
    assert torch.equal(out, want)


def _operands(case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``a`` [32, 32] in two experts' groups of 16, weights ``w`` [2, 32, 32] (nn.Linear's
    layout), an output gradient ``g`` [32, 32], with the half of the hidden dim that tp rank 1 holds
    set so that one scale's amax lies on rank 1 while rank 1's part of the product is zero:
    ``"a"``/``"w"``: w2's contracted dim (a's or w's rows scaled along it), ``"g"``/``"wt"``: w1's
    outputs (the input gradient's g or w scaled along them). Rank 0's elements then fall far below
    the unsharded amax, into e4m3's subnormals: a scale taken on rank 0's shard alone keeps them."""
    gen = torch.Generator().manual_seed(0)
    a, w, g = (torch.randn(*shape, generator=gen) for shape in ((32, 32), (2, 32, 32), (32, 32)))
    half = slice(16, 32)
    big = 1e4  # rank 0's elements land at about 0.01 in e4m3 (subnormal below 2^-6, zero below 2^-10)
    if case == "a":
        a[:, half] *= big
        w[:, :, half] = 0
    elif case == "w":
        w[:, :, half] *= big
        a[:, half] = 0
    elif case == "g":
        g[:, half] *= big
        w[:, half, :] = 0
    else:
        w[:, half, :] *= big
        g[:, half] = 0
    return a, w, g


def _sharded_product(rank: int, world: int, case: str) -> list[float]:
    """Rank ``rank``'s half of the hidden dim through the float8 experts' (emulated) grouped GEMM, as
    the trainer binds it under tp 2 (the library's ``max`` over the group); the sum over ranks of
    the forward product (w2: ``case`` ``a``/``w``) or of the input gradient (w1: ``g``/``wt``)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from torchtitan_spmd.models.moe import GroupedExperts
    from torchtitan_spmd.techniques.converters import _max_over
    from torchtitan_spmd.techniques.quantization import bind_float8_experts

    a, w, g = _operands(case)
    mine = slice(16 * rank, 16 * rank + 16)
    experts = nn.ModuleDict({"experts": GroupedExperts(32, 32, 2)})
    convert_model(experts, build_converters([Float8GroupedExpertsConverterConfig(emulate=True)]))
    layouts = {"experts.w1": SimpleNamespace(layout=SimpleNamespace(shard_dims=lambda: {"tp": 1}))}
    assert bind_float8_experts(experts, layouts, 2, _max_over(dist.group.WORLD)) == 1
    offs = torch.tensor([16, 32], dtype=torch.int32)
    if case in ("a", "w"):  # w2: the contracted dim sharded
        out = experts["experts"]._quantized_mm(a[:, mine].contiguous(), w[:, :, mine], offs, True)
    else:  # w1: the outputs sharded; the input gradient is a pending sum over tp
        x = a.clone().requires_grad_(True)
        experts["experts"]._quantized_mm(x, w[:, mine, :], offs, False).backward(g[:, mine].to(torch.bfloat16).float())
        out = x.grad.to(torch.bfloat16).float()
    dist.all_reduce(out)
    return out.reshape(-1).tolist()


@pytest.mark.parametrize("case", ["a", "w", "g", "wt"])
def test_float8_experts_scales_along_a_tp_shard_are_the_unsharded_ones(case: str) -> None:
    """Under tensor parallelism each scale along the experts' sharded hidden dim is the unsharded
    one: on two real gloo ranks, w2's product (its rows' and weights' scales along the contracted
    hidden dim) and w1's input gradient (its output gradient's and weights' scales along the
    hidden outputs) equal torchao's float8 matmul on the whole operands, where a scale taken on a
    rank's shard alone would keep the elements the unsharded scale sends to e4m3's subnormals."""
    from float8_helpers import torchao_float8_matmul

    from torchtitan_spmd.launcher import run_forked

    a, w, g = _operands(case)
    mm = torchao_float8_matmul()
    if case in ("a", "w"):
        want = torch.cat([mm(a[16 * e:16 * e + 16], w[e]) for e in range(2)])
    else:
        x = a.clone().requires_grad_(True)
        torch.cat([mm(x[16 * e:16 * e + 16], w[e]) for e in range(2)]).backward(g.to(torch.bfloat16).float())
        want = x.grad
    got = torch.tensor(run_forked(_sharded_product, 2, case)[0]).reshape(want.shape)
    scale = want.abs().max()
    assert scale > 0 and want.count_nonzero() > want.numel() // 2, "rank 0's part of the product survives"
    assert float((got - want).abs().max() / scale) < 1e-6, (case, float((got - want).abs().max() / scale))


def test_float8_experts_tensor_parallel_layouts_are_checked_in_one_line() -> None:
    from types import SimpleNamespace

    from torchtitan_spmd.techniques.quantization import bind_float8_experts

    layouts = {f"layers.{i}.moe.experts.w1": SimpleNamespace(layout=SimpleNamespace(shard_dims=lambda: {"tp": 1}))
               for i in range(2)}
    model = _moe_tiny()
    convert_model(model, build_converters([Float8GroupedExpertsConverterConfig(emulate=True)]))
    assert bind_float8_experts(model, layouts, 2, max) == 2  # hidden 64 / tp 2 = 32
    assert bind_float8_experts(model, layouts, 1, None) == 0
    with pytest.raises(ValueError) as err:
        bind_float8_experts(model, layouts, 8, max)
    assert "layers.0.moe.experts (hidden dim 64 / tp 8 = 8)" in _one_line(err.value)
    for experts in (model.get_submodule(f"layers.{i}.moe.experts") for i in range(2)):
        experts.float8_emulate = False  # the GPU's torchao kernels: they would scale each shard alone
    with pytest.raises(ValueError) as err:
        bind_float8_experts(model, layouts, 2, max)
    assert "torchao's float8 grouped kernels would scale each shard alone" in _one_line(err.value)


def test_a_long_list_of_modules_stays_one_short_line() -> None:
    """A 671B model's 58 MoE blocks in an error: the first eight and how many more."""
    from torchtitan_spmd.techniques.quantization import _name_list

    names = [f"layers.{i}.moe.experts" for i in range(3, 61)]
    assert _name_list(names) == ", ".join(names[:8]) + " and 50 more"
    assert _name_list(names[:8]) == ", ".join(names[:8])


#: cell -> (backend, parallelism, tolerance): the tiny MoE, experts in float8 rowwise (emulated),
#: routed round-robin; the attention linears and the output in high precision. Type-checked
#: ``spmd_types`` cells: layer 4.
F8_EXPERT_CELLS: dict[str, tuple[str, dict[str, Any], float]] = {
    "default-fsdp4": ("default", {"data_parallel_shard_degree": 4}, F8_TOL),
    "full_dtensor-fsdp4": ("full_dtensor", {"data_parallel_shard_degree": 4}, F8_TOL),
    "default-fsdp2_tp2": ("default", {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
                          MX_EXPERTS_SHARDED_TOL),
    "full_dtensor-fsdp2_tp2_ep2": ("full_dtensor", EP2, MX_EXPERTS_SHARDED_TOL),
}


@pytest.mark.parametrize("cell", list(F8_EXPERT_CELLS))
def test_float8_experts_match_torchaos_single_process_model(cell: str) -> None:
    """Against the same MoE on one process whose experts loop over torchao's float8 linear matmul:
    exact where the experts are whole on each rank (FSDP), within bfloat16's rounding of partial
    products (TP) or of other token groups' column scales (EP) where they are sharded."""
    backend, parallelism, tol = F8_EXPERT_CELLS[cell]
    check_float8_parity(cell, backend, (), parallelism, model="qwen3", recipe="float8_experts", tol=tol)


# ----------------------------------------------------------------------------- LoRA checkpoints
def _run(rank: int, world: int, cfg: Any) -> list[float]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    try:
        return [r.loss for r in trainer.run()]
    finally:
        trainer.close()


def test_lora_adapters_only_checkpoints_resume_exactly(tmp_path: Any) -> None:
    """``checkpoint.lora_adapters_only`` over a Hugging Face base (``initial_load_in_hf``, weights of
    another seed than the job's): the checkpoints hold the adapters (and the training state), no
    base weight; a run resumed from one reads the base again from the folder and continues with the
    losses of the run that was not stopped; a resume onto another base is one line naming both."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from float8_helpers import LORA, float8_job
    from parity_helpers import warm_parent

    from torchtitan_spmd.checkpoint.hf import save_hf
    from torchtitan_spmd.launcher import WorkerError, run_forked
    from torchtitan_spmd.models import get_model_spec
    from torchtitan_spmd.reference import initial_weights

    spec, hf = get_model_spec("llama3"), tmp_path / "hf"
    save_hf(initial_weights("llama3", "tiny", 99, 320), str(hf),
            spec.state_dict_adapter(spec.model_config("tiny", vocab_size=320)), dtype="float32")

    def job(folder: str, from_hf: bool = True) -> Any:
        cfg = float8_job("default", [LORA], parallelism={"data_parallel_shard_degree": 2}, steps=4)
        cfg.job.dump_folder = folder
        cfg.checkpoint.enable, cfg.checkpoint.interval, cfg.checkpoint.lora_adapters_only = True, 2, True
        cfg.checkpoint.last_save_model_only = False
        cfg.checkpoint.initial_load_in_hf, cfg.checkpoint.initial_load_path = from_hf, str(hf) if from_hf else None
        cfg.validate()
        return cfg

    warm_parent()
    whole = run_forked(_run, 2, job(str(tmp_path / "a")), timeout_s=120)[0]
    step2 = tmp_path / "a" / "checkpoint" / "step-2"
    keys = set(dcp.FileSystemReader(str(step2)).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.split(".", 1)[0] in ("layers", "output", "norm", "tok_embeddings")}
    assert model_keys and all(k.endswith((".lora_a", ".lora_b")) for k in model_keys), sorted(model_keys)[:4]
    assert len(model_keys) == 16  # 2 blocks x (wq, wk, wv, wo) x (a, b)
    assert any(k.startswith("optimizer.state.") and k.endswith(".lora_a.exp_avg") for k in keys)
    shutil.copytree(step2, tmp_path / "b" / "checkpoint" / "step-2")
    resumed = run_forked(_run, 2, job(str(tmp_path / "b")), timeout_s=120)[0]
    assert resumed == whole[2:], (resumed, whole)
    shutil.copytree(step2, tmp_path / "c" / "checkpoint" / "step-2")
    with pytest.raises(WorkerError, match=r"holds LoRA's adapters only, trained on the base from Hugging Face "
                                          r".*/hf; this run's base comes from initialisation, debug.seed 1234"):
        run_forked(_run, 2, job(str(tmp_path / "c"), from_hf=False), timeout_s=120)


def test_adapters_only_over_a_dcp_base_is_a_setup_error() -> None:
    from torchtitan_spmd.config import CheckpointConfig

    with pytest.raises(ValueError, match=r"lora_adapters_only cannot be used with a DCP initial_load_path") as err:
        CheckpointConfig(lora_adapters_only=True, initial_load_path="/seed/step-0")
    _one_line(err.value)
    CheckpointConfig(lora_adapters_only=True, initial_load_path="/hf", initial_load_in_hf=True)


def test_a_fresh_process_building_every_emulated_converter_logs_no_enum_warning() -> None:
    """Every torchao module the converters import first is imported inside the quiet context: a
    fresh interpreter that builds float8, MXFP8 and MXFP8 experts converters, converts the tiny
    MoE and runs a step logs no ``Enum subclass`` warning."""
    import subprocess

    code = (
        "import torch\n"
        "from torchtitan_spmd.config.converters import (Float8LinearConverterConfig as F,\n"
        "    MXFP8LinearConverterConfig as M, MXFP8GroupedExpertsConverterConfig as E)\n"
        "from torchtitan_spmd.models import get_model_spec\n"
        "from torchtitan_spmd.techniques.converters import build_converters, convert_model\n"
        "for convs in ([E(emulate=True)], [M(emulate=True)], [F(emulate=True)]):\n"
        "    m = get_model_spec('qwen3').build_initialized('moe_tiny', seed=0, vocab_size=320, max_seq_len=64)\n"
        "    convert_model(m, build_converters(convs))\n"
        "    m(torch.randint(0, 320, (2, 32))).sum().backward()\n"
        "print('done')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-2000:]
    assert "is an Enum subclass" not in done.stderr, done.stderr[-2000:]


def test_importing_torchao_drops_only_torchs_enum_warning(caplog: pytest.LogCaptureFixture) -> None:
    """torch 2.14's ``_pytree`` warns when torchao 0.18 registers its ``KernelPreference`` enum as a
    pytree constant (at import). Torch's own ``register_constant`` on a str Enum of a torchao
    module, as torchao's: the warning within the library's import context is dropped, outside it
    (and for another package's enum within it) it is logged."""
    import enum
    import logging

    from torchtitan_spmd.techniques.quantization import _quiet_torchao_enum_warning

    def register(module: str) -> list[str]:
        cls = enum.Enum("KernelPreference", {"AUTO": "auto"}, module=module, type=str)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="torch.utils._pytree"):
            torch.utils._pytree.register_constant(cls)
        return [r.getMessage() for r in caplog.records if "is an Enum subclass" in r.getMessage()]

    assert len(register("torchao.quantization.fake")) == 1  # torch still warns (else this test is moot)
    with _quiet_torchao_enum_warning():
        assert register("torchao.quantization.fake") == []
        assert len(register("someone_else")) == 1
    assert len(register("torchao.quantization.fake")) == 1  # only while torchao is imported


def _nvfp4_operands(case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An input ``x`` [32, 64], a weight ``w`` [64, 64] and an output gradient ``g`` [32, 64], with tp
    rank 1's half of the sharded dim (``col-*``: the weight's rows, the outputs; ``row-*``: the
    features) scaled so that one operand's per-tensor amax lies on rank 1 while rank 1's part of
    the sum over tp is zero: ``col-w`` the weight, ``col-g`` the output gradient, ``row-x`` the input,
    ``row-w`` the weight. Rank 0's blocks then fall far below the unsharded amax, their e4m3
    scales into e4m3's subnormals: a scale taken on rank 0's shard alone keeps them exact."""
    gen = torch.Generator().manual_seed(0)
    x, w, g = (torch.randn(*shape, generator=gen) for shape in ((32, 64), (64, 64), (32, 64)))
    half = slice(32, 64)
    big = 1e5  # rank 0's block scales near 0.004: e4m3 subnormals (below 2^-6, steps of 2^-9)
    if case == "col-w":
        w[half, :] *= big
    elif case == "col-g":
        g[:, half] *= big
        w[half, :] = 0
    elif case == "row-x":
        x[:, half] *= big
        w[:, half] = 0
    else:
        w[:, half] *= big
        x[:, half] = 0
    return x, w, g


def _nvfp4_sharded(rank: int, world: int, case: str) -> list[list[float]]:
    """Rank ``rank``'s shard through the library's NVFP4 linear (emulated, rounding to nearest) as
    the trainer binds it under tp 2 (its ``max`` over the group): rank 0's part of the output, of
    the input gradient and of the weight gradient, each summed over tp where it is a pending sum."""
    import torch.distributed as dist

    from torchtitan_spmd.techniques.converters import _max_over
    from torchtitan_spmd.techniques.quantization import NVFP4Linear

    x, w, g = _nvfp4_operands(case)
    mine = slice(32 * rank, 32 * rank + 32)
    col = case.startswith("col")
    linear = NVFP4Linear(64 if col else 32, 32 if col else 64, bias=False)
    linear.weight = nn.Parameter(w[mine].clone() if col else w[:, mine].clone())
    linear.nvfp4_emulate, linear.tp_weight_shard_dim, linear.amax_reduce = True, 0 if col else 1, _max_over(dist.group.WORLD)
    xs = (x if col else x[:, mine]).clone().requires_grad_(True)
    out = linear(xs)
    out.backward(g[:, mine] if col else g)
    grad_x = xs.grad
    if col:
        dist.all_reduce(grad_x)
    else:
        dist.all_reduce(out)
    return [t.reshape(-1).tolist() for t in (out, grad_x, linear.weight.grad)]


@pytest.mark.parametrize("case", ["col-w", "col-g", "row-x", "row-w"])
def test_nvfp4_per_tensor_scales_of_tp_shards_are_the_unsharded_ones(case: str) -> None:
    """Under tensor parallelism each NVFP4 per-tensor scale of a sharded operand is the unsharded
    one: on two real gloo ranks, rank 0's part of the output, the input gradient and the weight
    gradient equal the judge's (:class:`float8_helpers.JudgeNVFP4Matmul`, on the whole operands,
    rounding to nearest as the library does here), where each rank taking its own shard's amax
    would scale rank 0's blocks far finer."""
    from float8_helpers import JudgeNVFP4Matmul, nvfp4_round_to_nearest

    from torchtitan_spmd.launcher import run_forked

    x, w, g = _nvfp4_operands(case)
    xs = x.clone().requires_grad_(True)
    ws = w.clone().requires_grad_(True)
    out = JudgeNVFP4Matmul.apply(xs, ws)
    out.backward(g)
    col = case.startswith("col")
    mine = slice(0, 32)
    out = out.detach()
    wants = (out[:, mine] if col else out, xs.grad if col else xs.grad[:, mine], ws.grad[mine] if col else ws.grad[:, mine])
    with nvfp4_round_to_nearest():
        gots = run_forked(_nvfp4_sharded, 2, case)[0]
    for what, got, want in zip(("output", "input gradient", "weight gradient"), gots, wants, strict=True):
        got = torch.tensor(got).reshape(want.shape)
        scale = want.abs().max()
        assert scale > 0 and want.count_nonzero() > want.numel() // 2, (case, what, "rank 0's part survives")
        # each product is rounded to bfloat16 once (per rank): a float32 sum (the library's) and a
        # float64 one (the judge's) may round to neighbouring bfloat16 values, one ulp apart (2^-7 at most)
        assert torch.allclose(got, want, rtol=2**-7, atol=1e-6 * float(scale)), (
            case, what, float(((got - want).abs() / (want.abs() + 1e-6 * scale)).max()))



# ----------------------------------------------------------------------------- NVFP4
def test_nvfp4_converts_the_linears_it_can_and_names_the_ones_it_cannot() -> None:
    """Every linear whose dimensions are multiples of 16 (emulated; 128 for torchao's kernels) when
    ``fqns`` is empty; only the named ones otherwise (upstream's ``layers.1.`` names block 1
    alone); a named linear NVFP4 cannot take, a name matching nothing, or emulate with compile is
    one line at setup; the dry run's counts see them; LoRA composes over it."""
    from torchtitan_spmd.techniques.converters import converted_counts
    from torchtitan_spmd.techniques.quantization import hardware_checks_off

    model = _tiny()
    done = convert_model(model, build_converters([NVFP4LinearConverterConfig(emulate=True)]))
    assert len(done["NVFP4LinearConverter"]) == 15 and set(_kinds(model).values()) == {"NVFP4Linear"}
    counts = converted_counts(model)
    assert counts["nvfp4_linears"] == 15
    assert counts["nvfp4_weight_numel"] == sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))

    model = _tiny()
    convert_model(model, build_converters([NVFP4LinearConverterConfig(emulate=True, fqns=["layers.1.", "lm_head"]),
                                           LoRAConverterConfig(rank=4, target_modules=["wq"])]))
    kinds = _kinds(model)
    assert sorted(k for k, v in kinds.items() if "NVFP4" in v) == sorted(
        [f"layers.1.{m}" for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                   "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")] + ["output"])
    assert kinds["layers.1.attention.wq"] == "LoRANVFP4Linear" and kinds["layers.0.attention.wq"] == "LoRALinear"

    with hardware_checks_off():  # torchao's kernels: every dim a multiple of 128 (the tiny Llama's are not)
        gpu = build_converters([NVFP4LinearConverterConfig(model_compile_enabled=True)])
        assert convert_model(_tiny(), gpu)["NVFP4LinearConverter"] == []
        with pytest.raises(ValueError) as err:
            convert_model(_tiny(), build_converters([NVFP4LinearConverterConfig(fqns=["wq"], model_compile_enabled=True)]))
    assert "names 'layers.0.attention.wq' (64 -> 64)" in _one_line(err.value) and "multiples of 128" in str(err.value)

    _named_linears_errors(NVFP4LinearConverterConfig, 16, MXFP8LinearConverterConfig(emulate=True), "MXFP8Linear")


def test_nvfp4_cast_is_torchaos_own_nvfp4_quantize() -> None:
    """The library's NVFP4 cast of rows of 16, rounding to nearest, equals torchao's own pure-torch
    ``nvfp4_quantize`` (blocks of 16, two-level scales) on float32 data; zero and a tensor whose
    amax is 0 stay zero."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    from torchtitan_spmd.techniques.quantization import nvfp4_fake_quantize

    t = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 5
    amax = t.abs().max()
    scales, packed = nvfp4_quantize(t, 16, per_tensor_amax_to_scale(amax))
    codes = f4_unpacked_to_f32(unpack_uint4(packed)).reshape(64, 8, 16)
    want = (codes * scales.float().reshape(64, 8, 1) * per_tensor_amax_to_scale(amax)).reshape(64, 128)
    got = nvfp4_fake_quantize(t, amax)
    assert torch.equal(got, want)
    assert 0.05 < float((got - t).norm() / t.norm()) < 0.2  # e2m1's noise: a cast, not the identity
    zero = torch.zeros(32, 32)
    assert torch.equal(nvfp4_fake_quantize(zero, zero.abs().max()), zero)


def test_nvfp4_matches_the_judge_on_one_process_and_stops_on_a_partial_block() -> None:
    """One process, rounding to nearest. One linear, with the recipe's bfloat16 products: the
    output and both gradients equal the judge's (:class:`float8_helpers.JudgeNVFP4Matmul`, float64
    products) to a bfloat16 step each. The converted tiny Llama, in float32 products (a bfloat16
    step apart, the next cast to NVFP4 can move an e2m1 step): every gradient equals the judge
    model's, and differs from high precision. A forward whose tokens are no multiple of 16 is one
    line naming the fields to change."""
    from float8_helpers import (
        NV_STEP1_TOL,
        JudgeNVFP4Matmul,
        judge_nvfp4_model,
        nvfp4_float32_products,
        nvfp4_round_to_nearest,
    )

    from torchtitan_spmd.models import get_model_spec
    from torchtitan_spmd.techniques.quantization import NVFP4Linear

    gen = torch.Generator().manual_seed(4)
    x, w, g = torch.randn(2, 32, 64, generator=gen), torch.randn(96, 64, generator=gen), torch.randn(2, 32, 96, generator=gen)
    linear = NVFP4Linear(64, 96, bias=False)
    linear.weight, linear.nvfp4_emulate = nn.Parameter(w.clone()), True
    xs, xj, wj = x.clone().requires_grad_(True), x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with nvfp4_round_to_nearest():
        out = linear(xs)
        out.backward(g)
    want = JudgeNVFP4Matmul.apply(xj, wj)
    want.backward(g)
    for got, ref in ((out, want), (xs.grad, xj.grad), (linear.weight.grad, wj.grad)):
        # float32 sums against float64 ones: a bfloat16 step apart (2^-7 at most), or float32's error
        # of a sum of 64 terms where it cancels to near zero
        assert torch.allclose(got.detach(), ref.detach(), rtol=2**-7, atol=1e-5 * float(ref.detach().abs().max()))

    spec = get_model_spec("llama3")
    ours, judge, plain = (spec.build_initialized("tiny", seed=0, vocab_size=320, max_seq_len=64) for _ in range(3))
    convert_model(ours, build_converters([NVFP4LinearConverterConfig(emulate=True)]))
    assert judge_nvfp4_model(judge, ()) == 15
    tokens = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    grads = []
    with nvfp4_round_to_nearest(), nvfp4_float32_products():
        for model in (ours, judge, plain):
            model(tokens).pow(2).mean().backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        want = grads[1][name]
        assert float((grad - want).norm() / want.norm()) < NV_STEP1_TOL, (name, float((grad - want).norm() / want.norm()))
    assert not torch.allclose(grads[0]["output.weight"], grads[2]["output.weight"], rtol=1e-2, atol=0)
    with pytest.raises(ValueError) as err:
        ours(tokens[:1, :8])
    assert "has 8 tokens, not a multiple of 16" in _one_line(err.value)
    assert "training.local_batch_size" in str(err.value)


def test_nvfp4_gradients_round_stochastically_and_unbiased() -> None:
    """The recipe's stochastic rounding: each element lands on one of its two e2m1 neighbours, the
    mean over draws is the element (unbiased), and the gradients' casts use it: a linear's input
    gradient changes with the seed and averages closer to the exact product than rounding to
    nearest does; the forward does not change with the seed."""
    from float8_helpers import nvfp4_round_to_nearest

    from torchtitan_spmd.techniques.quantization import NVFP4Linear, nvfp4_fake_quantize

    t = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    amax = t.abs().max()
    torch.manual_seed(0)
    draws = torch.stack([nvfp4_fake_quantize(t, amax, stochastic=True) for _ in range(400)])
    nearest = nvfp4_fake_quantize(t, amax)
    lo, hi = torch.minimum(draws.amin(0), nearest), torch.maximum(draws.amax(0), nearest)
    assert (draws.amin(0) != draws.amax(0)).float().mean() > 0.5  # most elements take both neighbours
    spread = hi - lo
    assert float((draws.mean(0) - t).abs().max()) < float(spread.max()) * 0.2  # within the sampling error
    assert float((draws.mean(0) - t).norm()) < 0.3 * float((nearest - t).norm())

    linear = NVFP4Linear(64, 32, bias=False)
    linear.nvfp4_emulate = True
    x, g = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2)), torch.randn(2, 16, 32)

    def input_grad(seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        if seed is not None:
            torch.manual_seed(seed)
        xs = x.clone().requires_grad_(True)
        out = linear(xs)
        out.backward(g)
        return out.detach(), xs.grad

    out0, grad0 = input_grad(0)
    out1, grad1 = input_grad(1)
    assert torch.equal(out0, out1) and not torch.equal(grad0, grad1)
    with nvfp4_round_to_nearest():
        _, rn = input_grad(None)
    exact = g @ linear.weight.detach()
    mean = torch.stack([input_grad(s)[1] for s in range(64)]).mean(0)
    assert float((mean - exact).norm()) < float((rn - exact).norm())


def test_nvfp4_tensor_parallel_layouts_are_checked_in_one_line() -> None:
    """A shard that splits NVFP4's blocks, or tp-sharded linears on torchao's GPU kernels (each
    shard's own per-tensor scale), is a setup error naming the linears."""
    from types import SimpleNamespace

    from torchtitan_spmd.techniques.quantization import NVFP4Linear, bind_nvfp4_shards

    model = _tiny()
    convert_model(model, build_converters([NVFP4LinearConverterConfig(emulate=True)]))

    def col(dim: int) -> Any:
        return SimpleNamespace(layout=SimpleNamespace(shard_dims=lambda: {"tp": dim}))

    layouts = {f"{fqn}.weight": col(1 if fqn.endswith(("wo", "w2")) else 0)
               for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert bind_nvfp4_shards(model, layouts, 1, None) == 0
    assert bind_nvfp4_shards(model, layouts, 2, max) == 15  # wk: 32 / tp 2 = 16, one block
    assert model.get_submodule("layers.0.attention.wo").tp_weight_shard_dim == 1
    with pytest.raises(ValueError) as err:
        bind_nvfp4_shards(model, layouts, 4, max)
    text = _one_line(err.value)
    assert "layers.0.attention.wk (32 / tp 4 = 8)" in text and "attention.wq" not in text
    gpu = nn.ModuleDict({"proj": NVFP4Linear(512, 512, bias=False, device="meta")})  # torchao's kernels
    assert bind_nvfp4_shards(gpu, {}, 2, max) == 0  # nothing sharded over tp: the GPU's kernels are right
    with pytest.raises(ValueError) as err:
        bind_nvfp4_shards(gpu, {"proj.weight": col(0)}, 2, max)
    assert "shards proj, and torchao's NVFP4 kernels would take each shard's per-tensor scale" in _one_line(err.value)
    with pytest.raises(ValueError) as err:
        bind_nvfp4_shards(gpu, {"proj.weight": col(1)}, 8, max)
    assert "proj (512 / tp 8 = 64)" in _one_line(err.value)  # torchao's kernels: 128 a shard


#: cell -> (backend, parallelism): the tiny Llama, every linear NVFP4 (emulated), rounding to nearest
#: in float32 products (:func:`float8_helpers.nvfp4_float32_products`). Type-checked ``spmd_types``: layer 4.
NV_CELLS: dict[str, tuple[str, dict[str, Any] | None, int]] = {
    "default-fsdp2_tp2": ("default", None, 2),
    "full_dtensor-fsdp2_tp2": ("full_dtensor", None, 2),
    # one row a microbatch: 32 tokens, two blocks along the tokens
    "default-pp2_fsdp2": ("default", PP2_FSDP2, 1),
    # each CP rank's 32 tokens (headtail chunks); the judge's linears see each rank's on their own
    "full_dtensor-cp2_tp2": ("full_dtensor", {"context_parallel_degree": 2, "tensor_parallel_degree": 2}, 2),
}


@pytest.mark.parametrize("cell", list(NV_CELLS))
def test_nvfp4_matches_the_judges_single_process_model(cell: str) -> None:
    """NVFP4 emulated against the judge's model on one process: every per-tensor scale of a
    tp-sharded operand is the unsharded one (reduced over tp), each rank's tokens scaled on their
    own (data, context and pipeline parallelism), so only float32's summation order differs at
    step 1 (measured 1.9e-7 at FSDP 2 x TP 2, held to ``NV_STEP1_TOL``; each rank's own amaxes
    instead: 3.7e-2)."""
    from float8_helpers import NV_STEP1_TOL

    backend, parallelism, rows = NV_CELLS[cell]
    check_float8_parity(cell, backend, (), parallelism, rows, recipe="nvfp4", tol=NV_STEP1_TOL)


def test_nvfp4_gpu_path_calls_torchaos_kernel_as_upstream_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """``emulate=False`` (the SM100 path, which has not run here): the linear hands torchao's
    ``nvfp4_mm_triton`` its forward's arguments as upstream's ``NVFP4Linear`` does (no bias inside,
    a per-module int64 seed that stays, the fixed Hadamard signs), its backward a bfloat16 output
    gradient, and returns the output and both gradients in the operands' dtypes; a forward whose
    tokens are no multiple of 128 is one line. torchao's Triton kernel is replaced here by a
    recording stand-in computing in bfloat16."""
    import torchao.prototype.moe_training.nvfp4_training.nvfp4_linear as torchao_nvfp4

    from torchtitan_spmd.techniques.quantization import NVFP4_RHT_SIGNS, NVFP4Linear

    calls: list[tuple[str, Any]] = []

    class StandIn:
        @staticmethod
        def forward(ctx: Any, input_hp: torch.Tensor, weight_hp: torch.Tensor, bias: Any, sr_seed: torch.Tensor,
                    sign_vector: Any) -> torch.Tensor:
            calls.append(("forward", (input_hp.dtype, bias, sr_seed, tuple(sign_vector))))
            x, w = input_hp.to(torch.bfloat16), weight_hp.to(torch.bfloat16)
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
            calls.append(("backward", grad.dtype))
            x, w = ctx.saved_tensors
            return grad @ w, (grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])), None, None, None

    monkeypatch.setattr(torchao_nvfp4, "nvfp4_mm_triton", StandIn)
    linear = NVFP4Linear(128, 256, bias=True)
    x = torch.randn(2, 64, 128, requires_grad=True)
    for _ in range(2):
        out = linear(x)
        out.sum().backward()
    assert out.dtype == x.grad.dtype == linear.weight.grad.dtype == torch.float32
    (_, (dtype, bias, seed, signs)), (_, grad_dtype), (_, (_, _, seed2, _)), _ = calls
    assert (dtype, bias, signs, grad_dtype) == (torch.float32, None, NVFP4_RHT_SIGNS, torch.bfloat16)
    assert seed.dtype == torch.int64 and seed.shape == (1,) and seed2 is seed  # drawn once, kept
    want = x.detach().to(torch.bfloat16) @ linear.weight.detach().to(torch.bfloat16).t()
    assert torch.equal(out.detach(), want.float() + linear.bias.detach())
    with pytest.raises(ValueError) as err:
        linear(torch.randn(1, 64, 128))
    assert "has 64 tokens, not a multiple of 128" in _one_line(err.value)
