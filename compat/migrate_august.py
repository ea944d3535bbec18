"""The codemod's second step: a fork's tree from upstream's June spellings (a0c831c49) to August's (b5bcd76).

Run it as ``python -m torchtitan_spmd.compat.migrate --to august PATH...`` (the first step,
``full_dtensor`` -> ``spmd_backend``, runs first). Each rewrite is mechanical and idempotent;
what is not mechanical is left and reported as a review site (``file:line: review: ...``).

Python (``libcst``; formatting and comments kept):

- ``"default"`` compared with ``X.spmd_backend`` or ``get_spmd_backend()``, passed as
  ``spmd_backend="default"`` or assigned to ``X.spmd_backend`` becomes ``"partial_dtensor"``
  (#4085);
- ``X.spmd_meshes()[0]`` becomes ``X.spmd_dense_mesh()`` and ``X.spmd_meshes()[1]`` /
  ``[-1]`` ``X.spmd_sparse_mesh()`` (#4217), each reported: under ``spmd_types`` the new
  getters keep size-1 axes, which ``spmd_meshes()`` drops; any other ``spmd_meshes()`` use
  is reported only;
- a ``TrainingConfig(...)`` call that passes ``seq_len=S`` becomes
  ``max_context_length=S``, with ``local_batch_size=L`` ->
  ``num_tokens_per_microbatch_per_dp_rank=L * S`` and ``global_batch_size=G`` ->
  ``num_tokens_per_train_step=G * S`` (``-1`` stays ``-1``) (#4121); without ``seq_len``
  the batch keywords are reported (their token count needs the sequence length);
- a comparison with ``"full_dtensor"`` is reported (upstream removed the backend, #4217;
  this library keeps it).

Shell and YAML: ``--parallelism.spmd_backend default`` (or ``=default``) becomes
``partial_dtensor`` and ``--training.seq_len`` becomes ``--training.max_context_length``;
``--training.local_batch_size`` / ``global_batch_size`` flags are reported.
TOML: ``spmd_backend = "default"`` becomes ``"partial_dtensor"`` and ``seq_len`` under
``[training]`` ``max_context_length``; batch keys are reported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ReviewSite", "StepResult", "migrate_cli_text_august", "migrate_python_august", "migrate_toml_august"]


@dataclass(frozen=True)
class ReviewSite:
    """A place a human should look at: 1-based ``line`` and what to check (as the first step's)."""

    line: int
    message: str


@dataclass
class StepResult:
    """The rewritten ``text`` and the sites that need a human's review."""

    text: str
    review_sites: list[ReviewSite] = field(default_factory=list)


def _import_libcst() -> Any:
    try:
        import libcst
        import libcst.metadata  # noqa: F401
    except ImportError as exc:
        raise ImportError("Rewriting Python files needs libcst, which is not installed; install the "
                          "'migrate' extra: pip install torchtitan-spmd[migrate]") from exc
    return libcst

_NEW = "partial_dtensor"

_NOTE_MESHES = ("spmd_meshes() became {new}: upstream b5bcd76's getter (#4217); under spmd_types it "
                "keeps size-1 axes, which spmd_meshes() dropped; check the mesh's users")
_NOTE_MESHES_OTHER = ("spmd_meshes() is gone upstream (#4217): use spmd_dense_mesh() / spmd_sparse_mesh() "
                      "(or get_activated_mesh) by hand")
_NOTE_FULL = ('a comparison with "full_dtensor": upstream removed that backend (#4217); torchtitan_spmd keeps '
              "it as an extension, but a fork at b5bcd76 usually deletes this branch")
_NOTE_BATCH = ("{name} without seq_len in the same TrainingConfig(...) call: August counts tokens "
               "(num_tokens_per_microbatch_per_dp_rank = local_batch_size * seq_len, "
               "num_tokens_per_train_step = global_batch_size * seq_len); rewrite it by hand")


def _transformer() -> type:
    cst = _import_libcst()
    m = cst.metadata

    def is_backend_expr(node: Any) -> bool:
        if isinstance(node, cst.Attribute) and node.attr.value == "spmd_backend":
            return True
        return (isinstance(node, cst.Call) and not node.args
                and ((isinstance(node.func, cst.Name) and node.func.value == "get_spmd_backend")
                     or (isinstance(node.func, cst.Attribute) and node.func.attr.value == "get_spmd_backend")))

    def string_value(node: Any) -> str | None:
        if isinstance(node, cst.SimpleString):
            try:
                value = node.evaluated_value
            except Exception:  # noqa: BLE001 - bytes or odd prefixes: not ours
                return None
            return value if isinstance(value, str) else None
        return None

    def requote(node: Any) -> Any:
        raw = node.value
        prefix = raw[: len(raw) - len(raw.lstrip("rRbBuUfF"))]
        quote = raw[len(prefix)]
        return node.with_changes(value=f"{prefix}{quote}{_NEW}{quote}")

    class August(cst.CSTTransformer):
        METADATA_DEPENDENCIES = (m.PositionProvider,)

        def __init__(self) -> None:
            super().__init__()
            self.sites: list[ReviewSite] = []
            self.pending_meshes: list[int] = []

        def _note(self, node: Any, message: str) -> None:
            self.sites.append(ReviewSite(self.get_metadata(m.PositionProvider, node).start.line, message))

        # "default" next to spmd_backend
        def leave_Comparison(self, original: Any, updated: Any) -> Any:
            left = updated.left
            targets = updated.comparisons
            if len(targets) != 1:
                return updated
            right = targets[0].comparator
            for backend_side, literal_side, put in ((left, right, "right"), (right, left, "left")):
                if is_backend_expr(backend_side):
                    value = string_value(literal_side)
                    if value == "default":
                        new = requote(literal_side)
                        if put == "right":
                            return updated.with_changes(comparisons=[targets[0].with_changes(comparator=new)])
                        return updated.with_changes(left=new)
                    if value == "full_dtensor":
                        self._note(original, _NOTE_FULL)
            return updated

        def leave_Arg(self, original: Any, updated: Any) -> Any:
            if updated.keyword is not None and updated.keyword.value == "spmd_backend":
                if string_value(updated.value) == "default":
                    return updated.with_changes(value=requote(updated.value))
            return updated

        def leave_Assign(self, original: Any, updated: Any) -> Any:
            if (len(updated.targets) == 1 and is_backend_expr(updated.targets[0].target)
                    and string_value(updated.value) == "default"):
                return updated.with_changes(value=requote(updated.value))
            return updated

        # spmd_meshes()
        def leave_Subscript(self, original: Any, updated: Any) -> Any:
            value = updated.value
            if (isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute)
                    and value.func.attr.value == "spmd_meshes" and not value.args
                    and len(updated.slice) == 1 and isinstance(updated.slice[0].slice, cst.Index)):
                index = updated.slice[0].slice.value
                text = cst.Module([]).code_for_node(index).strip()
                getter = {"0": "spmd_dense_mesh", "1": "spmd_sparse_mesh", "-1": "spmd_sparse_mesh"}.get(text)
                if getter is not None:
                    self._note(original, _NOTE_MESHES.format(new=f"{getter}()"))
                    return cst.Call(func=value.func.with_changes(attr=cst.Name(getter)))
            return updated

        def visit_Call(self, node: Any) -> None:
            func = node.func
            if isinstance(func, cst.Attribute) and func.attr.value == "spmd_meshes" and not node.args:
                # reported at the end unless leave_Subscript rewrote it (and noted it there)
                self.pending_meshes.append(self.get_metadata(m.PositionProvider, node).start.line)

        # TrainingConfig(...) batch fields -> token budgets
        def leave_Call(self, original: Any, updated: Any) -> Any:
            func = updated.func
            name = func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) \
                else None
            if name != "TrainingConfig":
                return updated
            by_name = {a.keyword.value: a for a in updated.args if a.keyword is not None}
            if "seq_len" not in by_name:
                for key in ("local_batch_size", "global_batch_size"):
                    if key in by_name:
                        self._note(original, _NOTE_BATCH.format(name=key))
                return updated
            seq = cst.Module([]).code_for_node(by_name["seq_len"].value).strip()
            seq_simple = re.fullmatch(r"[\w.]+", seq) is not None
            seq_text = seq if seq_simple else f"({seq})"
            new_args = []
            for arg in updated.args:
                key = arg.keyword.value if arg.keyword is not None else None
                if key == "seq_len":
                    arg = arg.with_changes(keyword=cst.Name("max_context_length"))
                elif key in ("local_batch_size", "global_batch_size"):
                    value = cst.Module([]).code_for_node(arg.value).strip()
                    new_key = ("num_tokens_per_microbatch_per_dp_rank" if key == "local_batch_size"
                               else "num_tokens_per_train_step")
                    if value == "-1":
                        expr = "-1"
                    else:
                        left = value if re.fullmatch(r"[\w.]+", value) else f"({value})"
                        expr = f"{left} * {seq_text}"
                    arg = arg.with_changes(keyword=cst.Name(new_key), value=cst.parse_expression(expr))
                new_args.append(arg)
            return updated.with_changes(args=new_args)

    return August


def migrate_python_august(source: str) -> StepResult:
    """The August step of one Python file's text (see the module docstring)."""
    cst = _import_libcst()
    module = cst.parse_module(source)
    wrapper = cst.metadata.MetadataWrapper(module)
    transformer = _transformer()()
    new = wrapper.visit(transformer)
    sites = list(transformer.sites)
    rewritten = {s.line for s in sites if s.message.startswith("spmd_meshes() became")}
    for line in transformer.pending_meshes:
        if line not in rewritten:
            sites.append(ReviewSite(line, _NOTE_MESHES_OTHER))
    sites.sort(key=lambda s: s.line)
    return StepResult(new.code, sites)


_CLI_BACKEND = re.compile(r"(--parallelism\.spmd[-_]backend(?:=|\s+))default\b")
_CLI_SEQ = re.compile(r"--training\.seq[-_]len\b")
_CLI_BATCH = re.compile(r"--training\.(local|global)[-_]batch[-_]size\b")


def migrate_cli_text_august(text: str) -> StepResult:
    """The August step of a shell or YAML file's text."""
    sites = [ReviewSite(text.count("\n", 0, m.start()) + 1,
                        f"{m.group(0)}: August counts tokens (--training.num_tokens_per_"
                        f"{'microbatch_per_dp_rank' if m.group(1) == 'local' else 'train_step'} = "
                        f"{m.group(1)}_batch_size * seq_len); rewrite it by hand")
             for m in _CLI_BATCH.finditer(text)]
    text = _CLI_BACKEND.sub(lambda m: m.group(1) + _NEW, text)
    text = _CLI_SEQ.sub("--training.max_context_length", text)
    return StepResult(text, sites)


_TOML_HEADER = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\"]+)\s*\]")
_TOML_BACKEND = re.compile(r"^(\s*spmd[_-]backend\s*=\s*)([\"'])default\2")
_TOML_SEQ = re.compile(r"^(\s*)seq[_-]len(\s*=)")
_TOML_BATCH = re.compile(r"^\s*(local|global)[_-]batch[_-]size\s*=")


def migrate_toml_august(text: str) -> StepResult:
    """The August step of a TOML file's text (the rest kept byte for byte)."""
    out: list[str] = []
    sites: list[ReviewSite] = []
    table = None
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        header = _TOML_HEADER.match(line)
        if header:
            table = header.group(1).strip('"')
        elif table == "parallelism":
            line = _TOML_BACKEND.sub(lambda m: f"{m.group(1)}{m.group(2)}{_NEW}{m.group(2)}", line)
        elif table == "training":
            line = _TOML_SEQ.sub(lambda m: f"{m.group(1)}max_context_length{m.group(2)}", line)
            if _TOML_BATCH.match(line):
                sites.append(ReviewSite(number, "a batch size: August counts tokens (see "
                                                "num_tokens_per_microbatch_per_dp_rank); rewrite it by hand"))
        out.append(line)
    return StepResult("".join(out), sites)
