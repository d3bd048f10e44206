# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

from trtllm_vtoken.cli import main, show_warning
from trtllm_vtoken.core import native


def test_bench_core_prints_table_and_writes_json(tmp_path, capsys):
    assert main(["bench", "core", "--batch", "8", "--context", "256", "--tokens-per-block", "16",
                 "--steps", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "dense |" in out and "lazy |" in out and "metadata B/token" in out
    assert (tmp_path / "core.png").stat().st_size > 0
    data = json.loads((tmp_path / "core.json").read_text())
    runs = {(r["config"]["impl"], r["config"]["mode"]): r for r in data["results"]}
    impls = ["calls", "python", "cpp"] if native.load() is not None else ["calls", "python"]
    assert sorted(runs) == sorted((i, m) for i in impls for m in ("dense", "lazy"))
    dense = runs["python", "dense"]
    assert dense["moves"] > 0 and 9.0 < dense["metadata_bytes_per_token"] < 12.0
    for impl, mode in runs:  # same seeded evictions: every implementation relocates and frees the same
        assert (runs[impl, mode]["moves"], runs[impl, mode]["blocks_freed"]) == \
            (runs["python", mode]["moves"], runs["python", mode]["blocks_freed"])


def test_bench_step_prints_table_and_writes_rows(tmp_path, capsys):
    assert main(["bench", "step", "--batches", "4", "--context", "96", "--tokens-per-block", "8", "--steps", "3",
                 "--repeats", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "indirection-only" in out and "vtoken dense h2o" in out and "added us" in out and "native us/step" in out
    assert (tmp_path / "step.png").stat().st_size > 0
    rows = json.loads((tmp_path / "step.json").read_text())
    impls = ["cpp", "python"] if native.load() is not None else ["python"]
    assert len(rows) == 1 + 5 * len(impls) + 1  # dense H2O at a block boundary once, with the first core
    for row in rows:
        assert {"variant", "mode", "policy", "impl", "batch", "host_us_p50", "added_us_p50", "native_us_p50",
                "added_pct"} <= set(row)
        assert row["batch"] == 4 and row["host_us_p50"] > 0
        evicting = row["variant"] == "vtoken"
        assert (row["evicted_per_step"] == 4) == evicting  # one eviction per request per step
    # Dense compaction mid-block: one move, no block changes hands; at a block boundary every request
    # allocates a block for its new token and releases it again.
    dense = [r for r in rows if (r["variant"], r["mode"], r["policy"]) == ("vtoken", "dense", "h2o")]
    assert {r["blocks_freed_per_step"] for r in dense if not r.get("boundary")} == {0}
    assert [r["blocks_freed_per_step"] for r in dense if r.get("boundary")] == [4]
    assert all(r["moves_per_step"] == 4 for r in dense)
    # The step alone, caches warm and flushed, and warm with the compaction timed: the same
    # evictions as in the engine, on every core; only the timed rows split the compaction's time
    alone = json.loads((tmp_path / "step_alone.json").read_text())
    assert sorted((r["label"], r["impl"], r["caches"]) for r in alone) == sorted(
        (label, impl, caches) for label in ("indirection-only", "vtoken dense h2o", "vtoken lazy h2o",
                                            "vtoken dense streaming_llm")
        for impl in impls for caches in ("warm", "flushed", "warm, timed"))
    for r in alone:
        assert r["batch"] == 4 and 0 < r["step_us_min"] <= r["step_us_p50"]
        assert r["evicted_per_step"] == (0 if r["label"] == "indirection-only" else 4)
        assert min(r["split_us"].values()) >= 0 and sum(r["split_us"].values()) > 0
        compacts = r["impl"] == "cpp" and r["label"] != "indirection-only" and r["caches"] == "warm, timed"
        assert (r["core_parts_us"]["commit"] > 0) == compacts
        assert sum(r["core_parts_us"].values()) <= r["split_us"]["core"]


def test_bench_step_with_the_simulated_attention_evicts_alike(tmp_path, capsys):
    """--mass synthetic: the simulated attention computes the mass (its time not counted); every
    evicting row still evicts one token per request per step; the native row is native paired
    with native."""
    assert main(["bench", "step", "--batches", "4", "--context", "96", "--tokens-per-block", "8", "--steps", "3",
                 "--repeats", "1", "--impl", "python", "--mass", "synthetic", "--out", str(tmp_path)]) == 0
    assert "simulated attention" in capsys.readouterr().out
    rows = json.loads((tmp_path / "step.json").read_text())
    assert {r["mass"] for r in rows} == {"synthetic"}
    assert all((r["evicted_per_step"] == 4) == (r["variant"] == "vtoken") for r in rows)
    native_row = rows[0]
    assert native_row["variant"] == "native" and native_row["step_us"] == 0 and native_row["native_us_p50"] > 0


@pytest.mark.skipif(native.load() is None, reason="the C++ core is not built")
def test_bench_step_with_a_mass_buffer_repeats_the_h2o_call(tmp_path, capsys):
    """--mass buffer: one array per batch handed over every step; the H2O rows repeat the call on
    the step's worker (a function of the layout, the default, never lets them) and evict, move
    and free as with the default. --mass forward (the same values as a forward's tensor, a new
    array each step) decides and repeats as the buffer."""
    rows = {}
    for mass in ("buffer", "forward", "fixed"):
        assert main(["bench", "step", "--batches", "4", "--context", "96", "--tokens-per-block", "8", "--steps", "3",
                     "--repeats", "1", "--impl", "cpp", "--mass", mass, "--out", str(tmp_path / mass)]) == 0
        rows[mass] = json.loads((tmp_path / mass / "step.json").read_text())
    out = capsys.readouterr().out
    assert "one mass buffer per batch" in out and "a new array each step" in out
    for buffer, forward in zip(rows["buffer"], rows["forward"]):  # the same decisions and repeats
        assert forward["mass"] == "forward"
        for key in ("evicted_per_step", "moves_per_step", "blocks_freed_per_step", "repeated_share"):
            assert forward[key] == buffer[key], (forward["label"], key)
    for buffer, fixed in zip(rows["buffer"], rows["fixed"]):
        assert buffer["label"] == fixed["label"] and buffer["mass"] == "buffer"
        for key in ("evicted_per_step", "moves_per_step", "blocks_freed_per_step"):
            assert buffer[key] == fixed[key], (buffer["label"], key)
        # Every timed step of a dense row repeats with the buffer (lazy rows and native never do);
        # with the default the rows that observe no attention only.
        assert buffer["repeated_share"] == (1.0 if buffer["mode"] == "dense" else 0.0), buffer["label"]
        repeats = buffer["mode"] == "dense" and buffer["policy"] != "h2o"
        assert fixed["repeated_share"] == (1.0 if repeats else 0.0), fixed["label"]


@pytest.mark.skipif(native.load() is None, reason="the C++ core is not built")
def test_bench_step_times_the_call_beside_sampling_against_the_call_at_once(tmp_path, capsys):
    """--impl cpp,cpp-at-once: the C++ core's call on the step's worker beside the engine's
    sampling and on the engine's thread, in one alternating run; the same evictions, moves and
    freed blocks either way, and each row's in-step time with its range over the runs."""
    assert main(["bench", "step", "--batches", "4", "--context", "96", "--tokens-per-block", "8", "--steps", "3",
                 "--repeats", "2", "--impl", "cpp,cpp-at-once", "--out", str(tmp_path)]) == 0
    assert "step runs min-max" in capsys.readouterr().out
    rows = json.loads((tmp_path / "step.json").read_text())
    by = {(r["variant"], r["mode"], r["policy"], r.get("boundary", False), r["impl"]): r for r in rows}
    pairs = [(key[:4], by[key], by[key[:4] + ("cpp-at-once",)]) for key in by if key[4] == "cpp" and
             key[:4] + ("cpp-at-once",) in by]
    assert len(pairs) == 5
    for _, beside, at_once in pairs:
        for name in ("evicted_per_step", "moves_per_step", "blocks_freed_per_step"):
            assert beside[name] == at_once[name], name
        assert 0 < beside["step_us_min"] <= beside["step_us"] <= beside["step_us_max"]
    # H2O's native pass alone at the batch's shape, on one and two threads, caches warm and flushed
    passes = json.loads((tmp_path / "step_pass.json").read_text())
    assert sorted((r["placement"], r["caches"], r["threads"]) for r in passes) == [
        (p, c, t) for p in ("contiguous", "scattered") for c in ("flushed", "warm") for t in (1, 2)]
    assert all(r["batch"] == 4 and 0 < r["pass_us_min"] <= r["pass_us_p50"] for r in passes)


def test_bench_step_refuses_an_unknown_core(capsys):
    assert main(["bench", "step", "--impl", "cpp,rust", "--out", "/tmp/unused"]) == 2
    assert capsys.readouterr().err.strip() == (
        "vtoken: error: --impl must list cores among cpp, python, cpp-at-once, cpp-overlap, cpp-at-once-overlap or be "
        "both, got "
        "'cpp,rust'")


def test_bad_arguments_give_one_line_error(capsys):
    assert main(["bench", "core", "--batch", "0", "--out", "/tmp/unused"]) == 2
    assert capsys.readouterr().err.strip() == "vtoken: error: batch must be positive, got 0"


def test_a_warning_is_one_line_as_an_error_is(capsys):
    """The engine config warns (drafting turns the overlap scheduler off), then refuses the policy."""
    assert main(["generate", "hi", "--max-draft-len", "3", "--policy", "lru"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "vtoken: warning: speculative_config turns the overlap scheduler off (as TensorRT-LLM does for NGram: a step "
        "beside the next forward would take its drafts in before they are verified)",
        "vtoken: error: Unknown eviction policy 'lru'. Known: h2o, random, scissorhands, sliding_window, streaming_llm"]
    assert warnings.showwarning is not show_warning  # Python's own display is back after the command


def test_info_and_import_is_light():
    assert main(["info"]) == 0
    code = "import sys, trtllm_vtoken; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.slow
def test_generate_streams_text_and_reports_blocks(capsys):
    assert main(["generate", "Write a haiku about the sea.", "--max-tokens", "12", "--budget", "24",
                 "--num-blocks", "16"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.strip()) > 10
    assert "[vtoken/dense, h2o] 12 tokens" in captured.err and "blocks reclaimed" in captured.err
    assert main(["generate", "hi", "--policy", "lru"]) == 2
    assert "Unknown eviction policy 'lru'" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_variants_table_json_and_plot(tmp_path, capsys):
    assert main(["bench", "variants", "--requests", "4", "--max-prompt-tokens", "96",
                 "--max-output-tokens", "8", "--num-blocks", "40", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "naive-evict" in out and "vtoken |  lazy" in out
    data = json.loads((tmp_path / "variants.json").read_text())
    runs = {(r["variant"], r["mode"]): r for r in data["runs"]}
    assert set(runs) == {("native", "-"), ("naive-evict", "-"), ("vtoken", "dense"), ("vtoken", "lazy")}
    assert runs[("native", "-")]["tokens_evicted"] == 0
    assert runs[("vtoken", "dense")]["invariant_checks"] == runs[("vtoken", "dense")]["relocations"] > 0
    assert (tmp_path / "variants.png").stat().st_size > 10_000


def test_bench_capacity_labels_simulated_results(tmp_path, capsys):
    assert main(["bench", "capacity", "--scale", "32", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "SIMULATED" in out and "(1/32 scale)" in out
    data = json.loads((tmp_path / "capacity.json").read_text())
    assert data["label"] == "simulated" and len(data["results"]) == 4
    first, fp8 = data["results"][0]["variants"], data["results"][3]
    assert first["vtoken"]["max_concurrency"] >= 2 * first["native"]["max_concurrency"]
    # the first setting's bytes as FP8 KV: twice the blocks, and vToken on top of it
    assert fp8["setting"]["kv_cache_dtype"] == "fp8" and fp8["setting"]["paper"] is None
    assert fp8["setting"]["num_blocks"] == 2 * 5427 // 32  # the paper's bytes as FP8, then scaled
    assert fp8["variants"]["vtoken"]["max_concurrency"] > first["vtoken"]["max_concurrency"]
    assert fp8["variants"]["native"]["max_concurrency"] > first["native"]["max_concurrency"]
    assert (tmp_path / "capacity.png").stat().st_size > 10_000
    assert main(["bench", "capacity", "--scale", "0", "--out", str(tmp_path)]) == 2


def test_rouge_l():
    from trtllm_vtoken.bench.quality import rouge_l

    assert rouge_l("the cat sat", "the cat sat") == 1.0
    assert rouge_l("the cat", "dog") == 0.0
    # LCS("a b c d", "a c d e") = "a c d": P = 3/4, R = 3/4.
    assert rouge_l("a b c d", "A c d e") == pytest.approx(0.75)
    assert rouge_l("", "") == 1.0 and rouge_l("", "x") == 0.0


def test_every_option_of_every_command_has_help():
    """``--help`` explains every option: a missing help string names the command and option."""
    import argparse

    from trtllm_vtoken.cli import build_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, path + [name])
            elif not action.help and not isinstance(action, argparse._HelpAction):
                missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), ["vtoken"])
    assert not missing, f"options without help: {missing}"


def test_quick_sets_the_sizes_the_command_line_leaves_unset():
    """Every benchmark's ``--quick`` sizes: each is what --quick sets where the command line gives
    no value, and a value given explicitly wins (it was ignored before, silently)."""
    from trtllm_vtoken.cli import build_parser
    from trtllm_vtoken.cli.bench_common import run_sized

    def sized(parser, argv: list[str]) -> dict:
        seen: dict = {}
        run_sized(lambda args: seen.update(vars(args)) or 0, parser.parse_args(argv))
        return seen

    checked = 0
    for name, parser in build_parser().parse_args(["bench", "all"]).benchmarks.items():
        for dest, value in parser.parse_args(["--quick"]).quick_sizes.items():
            explicit = "7" if isinstance(value, int) else "3,5"
            assert sized(parser, ["--quick"])[dest] == value, (name, dest)
            assert str(sized(parser, ["--quick", "--" + dest.replace("_", "-"), explicit])[dest]) == explicit, \
                (name, dest)
            assert sized(parser, [])[dest] != value, (name, dest)  # the full size without --quick
            checked += 1
    assert checked >= 45


@pytest.mark.skipif(native.load() is None, reason="the C++ core is not built")
def test_bench_step_overlap_rows_run_under_the_overlap_scheduler_with_the_device_time(tmp_path, capsys):
    """--impl ...-overlap: the rows and their native partners run the overlap scheduler; with
    --forward-us every paired step waits for the simulated device at least that long."""
    assert main(["bench", "step", "--batches", "4", "--context", "96", "--tokens-per-block", "8", "--steps", "3",
                 "--repeats", "1", "--impl", "cpp-at-once,cpp-at-once-overlap", "--forward-us", "3000",
                 "--out", str(tmp_path)]) == 0
    assert "3000 us of simulated device time" in capsys.readouterr().out
    rows = json.loads((tmp_path / "step.json").read_text())
    assert [r["label"] for r in rows[:2]] == ["native", "native overlap"]
    assert {r.get("overlap", False) for r in rows if r["impl"].endswith("-overlap")} == {True}
    assert all(r["native_us_p50"] >= 3000 and r["host_us_p50"] >= 3000 for r in rows)
    assert all(r["evicted_per_step"] == 4 for r in rows if r["variant"] == "vtoken")


def test_the_engine_options_turn_the_overlap_scheduler_off():
    import argparse

    from trtllm_vtoken.cli.engine_args import add_engine_args, engine_settings
    from trtllm_vtoken.runtime.config import EngineConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineConfig(**engine_settings(parser.parse_args([]))).overlap_scheduler
    assert not EngineConfig(**engine_settings(parser.parse_args(["--no-overlap-scheduler"]))).overlap_scheduler
    assert EngineConfig(**engine_settings(parser.parse_args([]))).decode_decision == "at_once"
    assert EngineConfig(**engine_settings(parser.parse_args(["--decode-decision", "lagged"]))).decode_decision == "lagged"
    with pytest.raises(ValueError, match="only the overlap scheduler runs"):
        EngineConfig(**engine_settings(parser.parse_args(["--no-overlap-scheduler", "--decode-decision", "lagged"])))


def test_engine_flags_for_chunked_prefill_and_drafting_reach_the_engine_config():
    import argparse

    from trtllm_vtoken.cli.engine_args import add_engine_args, engine_settings
    from trtllm_vtoken.runtime.config import EngineConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--max-draft-len", "3", "--no-overlap-scheduler", "--max-num-tokens", "96"])
    config = EngineConfig(**engine_settings(args))
    assert config.speculative_config.max_draft_len == 3 and config.max_num_tokens == 96
    args = parser.parse_args(["--enable-chunked-prefill", "--max-num-tokens", "96", "--no-prefix-caching",
                              "--max-batch-size", "8"])
    assert EngineConfig(**engine_settings(args)).prefill_chunk_tokens == 80
