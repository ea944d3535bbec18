"""Every code block of README.md and docs/*.md is run by a test or a doc check.

Each fenced block is preceded by an HTML comment saying what happens to it::

    <!-- doc-check: ci -->                 run here, in `nox -s cpu_tests` (the common run)
    <!-- doc-check: long -->               run by `nox -s docs_long` (DOCS_LONG=1), too slow for CI
    <!-- doc-check: no-run (reason) -->    never run; the reason is required (multi-node, GPU, ...)
    <!-- doc-check: output -->             what the runnable block before it prints: every line
                                           must appear in that block's output, in order (`...`
                                           inside a line matches anything; a line `...` skips)
    <!-- doc-check: illustration (regenerate: COMMAND) -->
                                           a sample (an output, an error line, a listing) that
                                           no test compares; COMMAND is how to make it afresh

A block without such a comment fails :func:`test_every_block_is_tagged`, and so does a block
that shows an output (no language, ``text`` or ``console``) tagged anything but ``output`` or
``illustration``: every sample is either compared or says how to regenerate it. A figure quoted
in prose comes from a compared block: :data:`QUOTES` and :func:`test_quoted_figures_are_checked_ones`.

How a runnable block runs: the blocks of one page run in order in one scratch folder (one per
page, so a page's later blocks see what its earlier ones wrote), which holds a link to the
repository's ``tests/`` (the examples' fixtures are ``tests/assets/...``). A ``python`` block
whose first line is a file-name comment (``# my_jobs.py``) is written to that file; any other
``python`` block runs as a script; a ``bash`` block runs under ``bash -e -o pipefail`` with the
test's interpreter first on ``PATH`` (so ``python`` and ``torchrun`` are the venv's) and the
repository and the scratch folder on ``PYTHONPATH``. A block whose tag's note says "in the
repository root" (the README's ``nox -s train``, which needs the ``noxfile.py``) runs there.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LONG = os.environ.get("DOCS_LONG", "") not in ("", "0")
TAG = re.compile(r"^<!-- doc-check: (ci|long|output|illustration|no-run)\b(.*?)-->\s*$")
RUNNABLE = {"python", "bash", "sh", "shell"}
OUTPUT_LANGS = {"", "text", "console", "output"}  # a block that shows what something printed


@dataclass
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    tag: str | None
    note: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` (top-level or indented in a list), each with its tag."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip()
                         for line in lines[i + 1:end])
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        tag = TAG.match(prev)
        found.append(Block(page, i + 1, lang, body + "\n", tag.group(1) if tag else None,
                           tag.group(2).strip() if tag else ""))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks_of(page)]


def test_every_block_is_tagged() -> None:
    untagged = [b.where for b in ALL if b.tag is None]
    assert not untagged, f"code blocks without a <!-- doc-check: ... --> comment: {untagged}"
    no_reason = [b.where for b in ALL if b.tag == "no-run" and not b.note.strip(" ()")]
    assert not no_reason, f"no-run blocks must say why: {no_reason}"
    wrong = [b.where for b in ALL if b.tag in ("ci", "long") and b.lang not in RUNNABLE]
    assert not wrong, f"ci/long blocks must be python or bash: {wrong}"
    samples = [b.where for b in ALL if b.lang in OUTPUT_LANGS and b.tag not in ("output", "illustration")]
    assert not samples, ("output blocks neither compared (`output` after a ci/long block) nor marked "
                         f"`illustration (regenerate: COMMAND)`: {samples}")
    no_command = [b.where for b in ALL if b.tag == "illustration" and not re.search(r"\bregenerate: \S", b.note)]
    assert not no_command, f"illustrations must say `(regenerate: COMMAND)`: {no_command}"
    orphans = [b.where for i, b in enumerate(ALL) if b.tag == "output"
               and not (i and ALL[i - 1].page == b.page and ALL[i - 1].tag in ("ci", "long"))]
    assert not orphans, f"output blocks must follow a runnable block: {orphans}"


def expect_output(expected: str, actual: str, where: str) -> None:
    """Every line of ``expected`` in ``actual``, in order; ``...`` matches anything."""
    lines = actual.splitlines()
    pos = 0
    for want in expected.strip("\n").splitlines():
        if want.strip() == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in want.strip().split("...")))
        for k in range(pos, len(lines)):
            if pattern.fullmatch(lines[k].strip()):
                pos = k + 1
                break
        else:
            raise AssertionError(f"{where}: the documented output line\n  {want}\nis not in what the "
                                 f"block printed (from line {pos + 1} on):\n" + "\n".join(lines[-60:]))


def run_block(block: Block, scratch: Path) -> str:
    """Run ``block`` in ``scratch``; return its stdout and stderr, interleaved as printed."""
    first = block.text.splitlines()[0] if block.text.strip() else ""
    named = re.fullmatch(r"#\s*([\w.-]+\.py)(:.*)?", first.strip())
    if block.lang == "python" and named:
        (scratch / named.group(1)).write_text(block.text)
        return ""
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
           "PYTHONPATH": os.pathsep.join([str(scratch), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if block.lang == "python":
        cmd = [sys.executable, "-c", block.text]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.text]
    cwd = ROOT if "in the repository root" in block.note else scratch  # e.g. `nox -s train`
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=1800)
    out = proc.stdout
    assert proc.returncode == 0, f"{block.where} exited {proc.returncode}:\n{block.text}\n---\n{out[-6000:]}"
    return out


def _children_cpu() -> float:
    """CPU seconds (user + system) of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _pages_to_run() -> list[Path]:
    wanted = {"ci", "long"} if LONG else {"ci"}
    return [p for p in PAGES if any(b.tag in wanted for b in blocks_of(p))]


@pytest.mark.parametrize("page", _pages_to_run(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_blocks_run(page: Path, tmp_path: Path) -> None:
    """Run the page's ci blocks (and long ones under DOCS_LONG=1) in order, checking outputs."""
    wanted = {"ci", "long"} if LONG else {"ci"}
    scratch = tmp_path / "work"
    scratch.mkdir()
    (scratch / "tests").symlink_to(ROOT / "tests")
    blocks = blocks_of(page)
    last: tuple[Block, str] | None = None
    timings = []
    for block in blocks:
        if block.tag in wanted:
            begin, cpu = time.monotonic(), _children_cpu()
            last = (block, run_block(block, scratch))
            timings.append(f"{block.where}: {time.monotonic() - begin:.1f} s wall, "
                           f"{_children_cpu() - cpu:.1f} s CPU")
        elif block.tag == "output":
            if last is not None:
                expect_output(block.text, last[1], block.where)
        else:
            last = None  # an output block after a block that did not run is not checked
    print("\n".join(timings))


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of the headings of ``page``."""
    anchors = set()
    inside = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        m = None if inside else re.match(r"^#+ (.*)$", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def test_every_relative_link_resolves() -> None:
    """Every link to a file of the repository, and to a heading in it, points at something."""
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_blocks_said_to_be_the_same_as_a_checked_one_are() -> None:
    """A ``no-run`` block whose reason says it is "the same command as docs/X.md's" is, word for
    word, a ``ci``/``long`` block of that page: the README's copy cannot drift from the run one."""
    claims = [(b, m.group(1)) for b in ALL if b.tag == "no-run"
              for m in [re.search(r"the same command as (docs/[\w.-]+\.md)'s", b.note)] if m]
    assert claims, "the README's recipe block makes such a claim"
    for block, page in claims:
        checked = [b.text for b in blocks_of(ROOT / page) if b.tag in ("ci", "long")]
        assert block.text in checked, f"{block.where} is not a checked block of {page}"


def test_illustrations_said_to_be_the_head_of_a_block_are() -> None:
    """An ``illustration`` whose note says it is "the head of docs/X.md's output" is, line for line,
    the start of an ``output`` block of that page (the README's copy of the dry-run report)."""
    claims = [(b, m.group(1)) for b in ALL if b.tag == "illustration"
              for m in [re.search(r"the head of (docs/[\w.-]+\.md)'s output", b.note)] if m]
    assert claims, "the README's dry-run report makes such a claim"
    for block, page in claims:
        outputs = [b.text.strip("\n").splitlines() for b in blocks_of(ROOT / page) if b.tag == "output"]
        head = block.text.strip("\n").splitlines()
        if head and head[-1].strip() == "...":
            head = head[:-1]
        assert any(lines[:len(head)] == head for lines in outputs), (
            f"{block.where} is not the head of an output block of {page}")


@dataclass(frozen=True)
class Quote:
    """A figure in a page's prose and the compared output line it comes from."""

    page: str
    prose: str
    """A regular expression of the prose; its groups are the figures."""

    source: str
    """The page whose ``output`` block holds the figures."""

    line: str
    """A regular expression of that block's line; its groups are the same figures, unrounded."""


#: Every figure quoted in prose from a command's output.
QUOTES = [
    Quote("docs/configuration.md", r"`nox -s train` \(50 steps of `debugmodel`, FSDP 2 × TP 2\) takes the "
          r"loss\s+from ([\d.]+) to ([\d.]+)", "README.md", r"done: loss ([\d.]+) -> ([\d.]+) in 50 steps"),
    Quote("README.md", r"the `nox -s train` run above takes the loss\s+from ([\d.]+) to ([\d.]+)",
          "README.md", r"done: loss ([\d.]+) -> ([\d.]+) in 50 steps"),
    Quote("README.md", r"405B recipe as written \(TP 8, async TP, compile\) on 16,384\s+ranks, about 3 minutes; "
          r"each rank holds ([\d.]+)x parameters / world",
          "docs/dry-run.md", r"405b: .*, per-rank parameters [\d,]+ = ([\d.]+)x total/world \([\d,]+\)"),
]


def _same_figure(quoted: str, measured: str) -> bool:
    """``quoted`` is ``measured``, or ``measured`` rounded to ``quoted``'s decimals."""
    if quoted == measured:
        return True
    try:
        decimals = len(quoted.partition(".")[2])
        return float(quoted) == round(float(measured), decimals)
    except ValueError:
        return False


def test_quoted_figures_are_checked_ones() -> None:
    """Each figure of :data:`QUOTES` is in a compared ``output`` block (one after a ci/long block),
    and the prose quotes it as that block has it: a stale figure fails here, with no run."""
    for quote in QUOTES:
        prose = re.search(quote.prose, (ROOT / quote.page).read_text())
        assert prose, f"{quote.page}: no prose matching {quote.prose!r} (reworded? update QUOTES)"
        found = [m for b in blocks_of(ROOT / quote.source) if b.tag == "output"
                 for line in b.text.splitlines() for m in [re.fullmatch(quote.line, line.strip())] if m]
        assert len(found) == 1, f"{quote.source}: {len(found)} output lines match {quote.line!r}, not one"
        for quoted, measured in zip(prose.groups(), found[0].groups(), strict=True):
            assert _same_figure(quoted, measured), (
                f"{quote.page} quotes {quoted}, but the checked output in {quote.source} says {measured}: "
                f"{prose.group(0)!r}")
