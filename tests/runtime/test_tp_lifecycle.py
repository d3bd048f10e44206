# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism's process lifecycle, with real scripts and real rank processes (the tiny
model, two gloo ranks of one thread; the tests that start ranks are marked slow):

- a script creating ``LLM(tensor_parallel_size=2)`` outside ``if __name__ == "__main__":`` is
  refused before anything is spawned, in one line naming the idiom; a rank that re-runs such a
  script all the same exits with that line, not multiprocessing's bootstrapping error;
- with the guard, TP=2 generates what TP=1 does, and a script that ends without closing the LLM
  exits cleanly with nothing on stderr (the ranks are closed at exit);
- a rank that fails in a collective, by an exception or by its process exiting, is reported with
  its own traceback (or exit code) at once, and the other rank is stopped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from trtllm_vtoken.runtime.parallel.launch import RankProcesses

REPO = Path(__file__).resolve().parents[2]
IDIOM = 'if __name__ == "__main__":'


def run_script(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)


def test_llm_at_a_scripts_top_level_is_refused_before_spawning(tmp_path, tiny_llm_folder):
    started = time.monotonic()
    done = run_script(tmp_path, """\
        import sys
        from trtllm_vtoken.runtime.llm import LLM

        llm = LLM(sys.argv[1], tensor_parallel_size=2)
        """, str(tiny_llm_folder))
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"RuntimeError: tensor parallelism starts one process per rank with multiprocessing's 'spawn', "
                    f"which re-runs {tmp_path / 'user_script.py'} in each rank: create the LLM under `{IDIOM}` "
                    "(line 4 creates it at the script's top level)")
    assert "bootstrapping" not in done.stderr and "vtoken-rank" not in done.stderr
    assert time.monotonic() - started < 60  # no model loaded, no rank started


def test_more_ranks_than_kv_heads_is_one_line_before_any_rank_starts(tiny_llm_folder, capsys, monkeypatch):
    from trtllm_vtoken.cli import main
    from trtllm_vtoken.runtime.model import LlamaConfig

    started = []
    monkeypatch.setattr(RankProcesses, "__init__", lambda *a, **k: started.append(a))
    heads = LlamaConfig.from_hf(tiny_llm_folder / "config.json").num_key_value_heads
    assert main(["generate", "hi", "--model", str(tiny_llm_folder), "--tp", str(heads + 1)]) == 2
    err = capsys.readouterr().err
    assert err == (f"vtoken: error: tensor_parallel_size {heads + 1} exceeds the model's {heads} KV heads: ranks "
                   "split attention by whole KV heads\n") and not started


def test_a_function_called_at_top_level_is_refused_at_the_call(tmp_path, tiny_llm_folder):
    done = run_script(tmp_path, """\
        import sys
        from trtllm_vtoken.runtime.llm import LLM


        def main():
            return LLM(sys.argv[1], tensor_parallel_size=2)


        main()
        """, str(tiny_llm_folder))
    assert done.returncode == 1 and "(line 9 creates it at the script's top level)" in done.stderr


@pytest.mark.slow
def test_a_rank_re_running_the_script_exits_with_the_same_one_line(tmp_path, tiny_llm_folder):
    """The parent's check is switched off here to reach the ranks: each re-runs the script, meets
    the LLM at its top level and exits with the idiom instead of multiprocessing's text."""
    done = run_script(tmp_path, """\
        import sys
        from trtllm_vtoken.runtime.parallel import main_guard
        from trtllm_vtoken.runtime.parallel.launch import RankProcesses

        main_guard.unguarded_line = lambda: None
        RankProcesses(sys.argv[1], 2, threads=1)
        """, str(tiny_llm_folder))
    assert done.returncode == 1
    rerun = (f"vtoken: a rank process re-running {tmp_path / 'user_script.py'} reached the start of the ranks at "
             f"the script's top level: create the LLM under `{IDIOM}`")
    assert rerun in done.stderr.splitlines()
    assert "RuntimeError: rank 0 failed to start:" in done.stderr
    assert "rank 0 exited with code 1 before it started" in done.stderr
    assert "An attempt has been made to start a new process" not in done.stderr


@pytest.mark.slow
def test_guarded_script_generates_as_one_process_and_exits_silently_without_closing(tmp_path, tiny_llm_folder):
    """Two LLMs left open: one dropped when its function returns (its ranks see the pipe close and
    leave), one alive until the interpreter exits (closed by the exit handler, before the script's
    own handler, registered earlier, runs: its ranks are gone by then)."""
    done = run_script(tmp_path, """\
        import atexit
        import os
        import sys
        from trtllm_vtoken.runtime.llm import LLM
        from trtllm_vtoken.runtime.sampling import SamplingParams

        PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]
        SETTINGS = dict(threads=1, num_blocks=32, tokens_per_block=4, max_seq_len=64, policy="h2o", budget=6)
        PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)


        def alive(pids):
            def exists(pid):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return False
                return True
            print("ranks alive at exit:", sum(map(exists, pids)))


        def generate_and_drop():
            llm = LLM(sys.argv[1], tensor_parallel_size=2, **SETTINGS)
            return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


        if __name__ == "__main__":
            pids = []
            atexit.register(alive, pids)
            alone = [o.outputs[0].token_ids for o in LLM(sys.argv[1], **SETTINGS).generate(PROMPTS, PARAMS)]
            dropped = generate_and_drop()
            llm = LLM(sys.argv[1], tensor_parallel_size=2, **SETTINGS)
            pids += llm.ranks.pids
            split = llm.generate(PROMPTS, PARAMS)
            print(dropped == alone, [o.outputs[0].token_ids for o in split] == alone,
                  [len(o.outputs[0].logprobs) for o in split])
            # no llm.close()
        """, str(tiny_llm_folder))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == ["True True [6, 6]", "ranks alive at exit: 0"]
    assert done.stderr == ""


def fail_on_rank_1(ranks, how: str) -> None:
    """Run on every rank (``RankProcesses.call``): rank 1 fails, rank 0 waits in an all-reduce
    that rank 1 never joins. ``exit_late``: rank 0's error reaches the launcher before rank 1's
    exit does (as a collective's reset connection can), and the exit is still what is reported."""
    if ranks.rank == 1:
        if how == "exit_late":
            time.sleep(0.3)  # well inside the launcher's grace (FAILURE_GRACE_S)
        if how in ("exit", "exit_late"):
            os._exit(3)
        raise ValueError("injected failure on rank 1")
    if how == "exit_late":
        raise ConnectionResetError("rank 0 lost its peer")
    ranks.all_reduce_sum(torch.zeros(4))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "exit", "exit_late"])
def test_a_failing_rank_is_reported_at_once_and_the_others_are_stopped(tiny_llm_folder, how):
    ranks = RankProcesses(tiny_llm_folder, 2, threads=1)
    pids = ranks.pids
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        ranks.call(fail_on_rank_1, how)
    assert time.monotonic() - started < 30  # not the collective's timeout (300 s)
    message = str(caught.value)
    if how == "raise":  # rank 1's own traceback, down to the failing line
        assert message.startswith("rank 1: Traceback (most recent call last):")
        assert "in fail_on_rank_1" in message and "ValueError: injected failure on rank 1" in message
    else:
        assert message.startswith("rank 1 exited with code 3 during a call")
    assert "(the other ranks were stopped" in message
    for pid in pids:  # both processes are gone (terminated and reaped)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="the rank processes are closed"):
        ranks.call(fail_on_rank_1, how)
