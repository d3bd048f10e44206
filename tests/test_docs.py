# SPDX-License-Identifier: Apache-2.0
"""README.md and every page of docs/ run as written, and every link and record they cite exists.

- Every ```python block of a page runs: per page, in order, in one namespace, as a reader would
  paste them into one session. Blocks that import tensorrt_llm run only where it imports. A block
  guarded by ``if __name__ == "__main__":`` (the tensor-parallel example, whose rank processes
  re-import their module) only defines its names here; tests/runtime/test_tensor_parallel.py runs
  what it runs.
- Every ``vtoken ...`` command line of a ```bash block parses with the CLI's own parser, every
  one-process ``vtoken generate`` line runs, and every ``python <file>`` / ``bash <file>`` /
  ``scripts/...`` it names exists.
- Every relative link of README.md, docs/ and benchmarks/RESULTS.md points at a file that exists,
  and every ``#anchor`` at a heading of the page it names.
- benchmarks/ holds only records that RESULTS.md cites, and stays small; README.md and
  RESULTS.md stay front pages.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
PAGE_IDS = [str(page.relative_to(ROOT)) for page in PAGES]


def fenced_blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def needs_trtllm(block: str) -> bool:
    return re.search(r"^\s*(from|import) tensorrt_llm\b", block, flags=re.M) is not None


def command_lines(block: str) -> list[list[str]]:
    """The block's commands as argument lists: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def test_readme_and_docs_have_python_blocks():
    assert len(fenced_blocks(README, "python")) >= 2
    assert sum(len(fenced_blocks(page, "python")) for page in PAGES[1:]) >= 6
    assert all(block.strip() for page in PAGES for block in fenced_blocks(page, "python"))


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if fenced_blocks(p, "python")],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run_as_written(page, smollm2_folder):
    """The real model loads as the pages' ``LLM(...)`` loads it (the fixture converts it once)."""
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for number, block in enumerate(fenced_blocks(page, "python"), 1):
        if needs_trtllm(block):
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compile(block, f"{page.name} python block {number}", "exec"), namespace)
            except Exception as exc:  # the block's number in the failure, then the error itself
                raise AssertionError(f"{page.name} python block {number} failed: {exc!r}") from exc
        ran += 1
    assert ran or all(needs_trtllm(b) for b in fenced_blocks(page, "python"))


@pytest.mark.trtllm
def test_tensorrt_llm_blocks_run_as_written():
    blocks = [(page, b) for page in PAGES for b in fenced_blocks(page, "python") if needs_trtllm(b)]
    assert blocks and importlib.util.find_spec("tensorrt_llm") is not None
    for page, block in blocks:
        exec(compile(block, f"{page.name} (TensorRT-LLM)", "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_shell_commands_parse_and_name_existing_files(page):
    from trtllm_vtoken.cli import build_parser

    for block in fenced_blocks(page, "bash"):
        for argv in command_lines(block):
            if argv[0] == "vtoken":
                try:
                    build_parser().parse_args(argv[1:])
                except SystemExit as exc:
                    raise AssertionError(f"{page.name}: `{shlex.join(argv)}` does not parse") from exc
            elif argv[0] in ("python", "bash") and not argv[1].startswith(("-", "TensorRT-LLM/")):
                assert (ROOT / argv[1]).is_file(), f"{page.name}: {argv[1]} does not exist"
            elif argv[0].startswith("scripts/"):
                assert (ROOT / argv[0]).is_file(), f"{page.name}: {argv[0]} does not exist"


@pytest.mark.slow
def test_generate_commands_run_as_written(smollm2_folder, capsys):
    """Every one-process ``vtoken generate`` line of the pages runs and exits 0 (the ``--tp`` one
    spawns rank processes: tests/runtime/test_tensor_parallel.py runs that path)."""
    from trtllm_vtoken.cli import main

    commands = {shlex.join(argv): argv for page in PAGES for block in fenced_blocks(page, "bash")
                for argv in command_lines(block) if argv[:2] == ["vtoken", "generate"] and "--tp" not in argv}
    assert len(commands) >= 2
    for line, argv in commands.items():
        assert main(argv[1:]) == 0, f"`{line}`: {capsys.readouterr().err}"


def test_results_commands_parse():
    """The ``vtoken ...`` commands RESULTS.md names (those without placeholders such as DIR or 1|0)."""
    from trtllm_vtoken.cli import build_parser

    commands = re.findall(r"`(vtoken [^`]*)`", RESULTS.read_text())
    concrete = [c for c in commands if "|" not in c and not re.search(r"\b[A-Z]{1,3}\b", c)]
    assert len(concrete) >= 10
    for command in concrete:
        try:
            build_parser().parse_args(shlex.split(command)[1:])
        except SystemExit as exc:
            raise AssertionError(f"RESULTS.md: `{command}` does not parse") from exc


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lowercase, punctuation but - and _ dropped, spaces -."""
    headings = re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M),
                          flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", [*PAGES, RESULTS], ids=[*PAGE_IDS, "benchmarks/RESULTS.md"])
def test_relative_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: link {target} points at nothing"
        if anchor and linked.suffix == ".md":
            assert anchor in heading_anchors(linked), f"{page.name}: no heading for #{anchor} in {linked.name}"


def test_every_record_is_cited_by_results():
    """A file under benchmarks/ is a record of a current claim: RESULTS.md names it or a folder of it."""
    text = RESULTS.read_text()
    for path in sorted((ROOT / "benchmarks").rglob("*")):
        if path.is_dir() or path == RESULTS:
            continue
        relative = path.relative_to(ROOT / "benchmarks")
        folders = [f"{parent}/" for parent in relative.parents if str(parent) != "."]
        cited = str(relative) in text or any(f"{folder}`" in text or f"({folder})" in text for folder in folders)
        assert cited, f"benchmarks/{relative} is cited nowhere in RESULTS.md (by itself or its folder)"


def test_front_pages_stay_short():
    assert len(README.read_text().splitlines()) <= 250
    assert len(RESULTS.read_text().splitlines()) <= 400
    size = sum(p.stat().st_size for p in (ROOT / "benchmarks").rglob("*") if p.is_file())
    assert size <= 2 * 1024 * 1024, f"benchmarks/ holds {size / 2**20:.1f} MiB"
