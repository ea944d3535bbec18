"""Layer 3: the Hugging Face state-dict adapters and config.json handling, in one process.

transformers is the reference: this library's weights through ``to_hf`` and its
``config.json`` must open as a transformers model with the same logits. The sharded path
(DCP's HF reader and writer on gloo ranks) is ``test_hf_checkpoint.py``'s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from hf_helpers import hf_model
from version_helpers import requires_torch

from torchtitan_spmd.checkpoint import hf as hf_checkpoint
from torchtitan_spmd.config import JobConfig, check_supported
from torchtitan_spmd.models import get_model_spec, hf_config
from torchtitan_spmd.models.common import count_parameters
from torchtitan_spmd.models.state_dict_adapter import HFConfigError

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

FAMILIES = ("llama3", "qwen3")


def _perturbed(family: str, config: object | None = None) -> torch.nn.Module:
    spec = get_model_spec(family)
    if config is None:
        model = spec.build_initialized("tiny", seed=3)
    else:  # a config of its own (e.g. no grouped-query attention: Q and K of one shape)
        model = spec.build(config)
        model.init_weights(3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))  # norms too: no weight stays 1
    return model.eval()


def _job(family: str, folder: Path | None, *, flavor: str = "tiny", **checkpoint: object) -> JobConfig:
    ck = {"enable": True, "initial_load_in_hf": True, **checkpoint}
    if folder is not None:
        ck["initial_load_path"] = str(folder)
    return JobConfig.from_dict({"model": {"name": family, "flavor": flavor}, "checkpoint": ck})


def _hf_folder(family: str, path: Path, **changes: object) -> Path:
    config = hf_model(family).config.to_dict()
    config.update(changes)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _mha_llama() -> object:
    from torchtitan_spmd.models.llama3 import LlamaConfig

    return LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=320, multiple_of=64,
                       norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64)


@pytest.mark.parametrize(("family", "config"), [("llama3", None), ("qwen3", None), ("llama3", _mha_llama())],
                         ids=["llama3", "qwen3", "llama3-mha"])
def test_to_hf_and_config_json_open_in_transformers_with_the_same_logits(family: str, config: object) -> None:
    model = _perturbed(family, config)
    adapter = get_model_spec(family).state_dict_adapter(model.config)
    hf_config = adapter.hf_config("float32")
    config = transformers.AutoConfig.for_model(**hf_config)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert type(hf).__name__ == hf_config["architectures"][0]
    ours = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf.load_state_dict(adapter.to_hf(ours), strict=True)
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (hf(tokens).logits - model(tokens)).abs().max().item()
    assert gap < 1e-5
    back = adapter.from_hf(adapter.to_hf(ours))
    assert sorted(back) == sorted(ours) and all(back[k].equal(ours[k]) for k in ours)


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_flavor_builds_the_sizes_of_config_json(family: str, tmp_path: Path) -> None:
    folder = _hf_folder(family, tmp_path, rms_norm_eps=3e-6, max_position_embeddings=96,
                        rope_parameters={"rope_type": "default", "rope_theta": 12345.0})
    spec = get_model_spec(family)
    config = hf_config.resolve_model_config(spec, _job(family, folder, flavor="from_hf"), vocab_size=320)
    assert (config.norm_eps, config.rope_theta, config.max_seq_len) == (3e-6, 12345.0, 96)
    with torch.device("meta"):
        ours, tiny = spec.build(config), spec.build(spec.model_config("tiny"))
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in tiny.state_dict().items()}
    assert count_parameters(ours) == hf_model(family).num_parameters() == {"llama3": 139_584, "qwen3": 164_288}[family]


@requires_torch("2.14", "Hugging Face checkpoints (DCP's CheckpointableTensor)")
@pytest.mark.parametrize(("family", "field", "value", "ours"), [
    ("llama3", "num_key_value_heads", 4, 2),
    ("llama3", "intermediate_size", 256, 192),
    ("qwen3", "head_dim", 16, 32),
    ("qwen3", "rms_norm_eps", 1e-5, 1e-6),
])
def test_config_json_mismatch_names_the_field_and_both_values(family: str, field: str, value: object, ours: object,
                                                              tmp_path: Path) -> None:
    folder = _hf_folder(family, tmp_path, **{field: value})
    with pytest.raises(HFConfigError, match=rf"{field}={value!r}, but model.flavor='tiny' has {field}={ours!r}"):
        hf_config.resolve_model_config(get_model_spec(family), _job(family, folder), vocab_size=320)


@requires_torch("2.14", "Hugging Face checkpoints (DCP's CheckpointableTensor)")
def test_config_json_of_another_family_or_variant_is_named(tmp_path: Path) -> None:
    llama = _hf_folder("llama3", tmp_path / "llama")
    with pytest.raises(HFConfigError, match="model_type='llama', but this family reads model_type='qwen3'"):
        hf_config.resolve_model_config(get_model_spec("qwen3"), _job("qwen3", llama), vocab_size=320)
    tied = _hf_folder("llama3", tmp_path / "tied", tie_word_embeddings=True)
    with pytest.raises(HFConfigError, match="tie_word_embeddings=True, but model.flavor='tiny' has tie_word_embeddings=False"):
        hf_config.resolve_model_config(get_model_spec("llama3"), _job("llama3", tied), vocab_size=320)
    scaled = _hf_folder("llama3", tmp_path / "scaled",
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "factor": 8.0})
    with pytest.raises(HFConfigError, match="rope_type='longrope' is not supported"):
        hf_config.resolve_model_config(get_model_spec("llama3"), _job("llama3", scaled, flavor="from_hf"),
                                           vocab_size=320)


@requires_torch("2.14", "Hugging Face checkpoints (DCP's CheckpointableTensor)")
def test_setup_errors_name_the_fields(tmp_path: Path) -> None:
    spec = get_model_spec("llama3")
    folder = _hf_folder("llama3", tmp_path)
    cases = [
        (_job("llama3", None), "checkpoint.initial_load_in_hf needs a Hugging Face folder: set checkpoint.initial_load_path"),
        (_job("llama3", folder, initial_load_model_only=False), "needs checkpoint.initial_load_model_only=True"),
        (_job("llama3", folder, last_save_in_hf=True, last_save_model_only=False),
         "checkpoint.last_save_in_hf=True needs checkpoint.last_save_model_only=True"),
        (JobConfig.from_dict({"model": {"flavor": "from_hf"}}), "model.flavor='from_hf' needs a Hugging Face folder"),
        (_job("llama3", folder, enable=False), r"checkpoint.initial_load_in_hf=True needs checkpoint.enable=True"),
    ]
    for job, message in cases:
        with pytest.raises(ValueError, match=message):
            hf_config.resolve_model_config(spec, job, vocab_size=320)
    with pytest.raises(HFConfigError, match="vocab_size=320 is smaller than the tokenizer's 400 ids"):
        hf_config.resolve_model_config(spec, _job("llama3", folder, flavor="from_hf"), vocab_size=400)
    check_supported(_job("llama3", folder, last_save_in_hf=True))  # no longer in the support table
    with pytest.raises(ValueError, match="checkpoint.initial_load_in_hf_quantized=True: loading quantized"):
        check_supported(_job("llama3", folder, initial_load_in_hf_quantized=True))


def test_missing_safetensors_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(hf_checkpoint.MissingExtraError, match=r'pip install -e "\.\[hf\]" \(in ') as info:
        hf_config.require_safetensors()
    assert isinstance(info.value, ValueError) and isinstance(info.value, ImportError)


@requires_torch("2.14", "Hugging Face checkpoints (DCP's CheckpointableTensor)")
def test_load_errors_name_the_folder_and_the_tensor(tmp_path: Path) -> None:
    model = get_model_spec("qwen3").build_initialized("tiny", seed=0)
    adapter = get_model_spec("qwen3").state_dict_adapter(model.config)
    with pytest.raises(ValueError, match="is not a Hugging Face checkpoint: it has no .safetensors file"):
        hf_checkpoint.load_hf(model.state_dict(), str(_hf_folder("qwen3", tmp_path / "empty")), adapter)
    with pytest.raises(ValueError, match="is not a Hugging Face checkpoint: it does not exist"):
        hf_checkpoint.load_hf(model.state_dict(), str(tmp_path / "nowhere"), adapter)
    # a Llama of the same shapes (head_dim 32) has no QK norms: the first missing tensor is named
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False))
    other.save_pretrained(str(tmp_path / "llama"))
    with pytest.raises(ValueError, match="has no tensor 'model.layers.0.self_attn.q_norm.weight'"):
        hf_checkpoint.load_hf(model.state_dict(), str(tmp_path / "llama"), adapter)
    from safetensors.torch import save_file

    hf_model("qwen3").save_pretrained(str(tmp_path / "extra"))
    save_file({"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}, str(tmp_path / "extra" / "bias.safetensors"))
    with pytest.raises(ValueError, match="holds 'model.layers.0.self_attn.q_proj.bias', which this qwen3 model lacks"):
        hf_checkpoint.load_hf(model.state_dict(), str(tmp_path / "extra"), adapter)
    wide = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False))
    wide.save_pretrained(str(tmp_path / "wide"))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(256, 64\) there and \(192, 64\)"):
        hf_checkpoint.load_hf(model.state_dict(), str(tmp_path / "wide"), adapter)


@pytest.mark.parametrize(("start", "n_rows"), [(0, 64), (0, 16), (16, 16), (8, 8), (3, 7), (61, 3), (1, 62)])
def test_row_runs_read_exactly_this_ranks_rows(start: int, n_rows: int) -> None:
    """A rank holding our rows [start, start + n_rows) of llama3's wq (4 heads of 16) reads them
    from the transformers tensor through the runs it describes, shard boundaries inside a head
    and inside a RoPE pair included (what DCP's reader does with a CheckpointableTensor)."""
    from torchtitan_spmd.checkpoint.hf import _RowRuns
    from torchtitan_spmd.models.llama3.state_dict_adapter import interleaved_to_half_rows

    ours = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    idx = interleaved_to_half_rows(4, 16)
    theirs = ours[idx]  # the transformers tensor
    local = torch.zeros(n_rows, 8)
    runs = _RowRuns(local, (start, 0), (64, 8), idx)
    buf = runs.buffer()
    covered = 0
    for g, lo, size in zip(runs.global_offsets, runs.local_offsets, runs.local_sizes, strict=True):
        buf[lo[0]:lo[0] + size[0]] = theirs[g[0]:g[0] + size[0], g[1]:g[1] + size[1]]
        covered += size[0]
    assert covered == n_rows and buf.global_shape == (64, 8)
    runs.scatter_back(buf)
    assert local.equal(ours[start:start + n_rows])
