# SPDX-License-Identifier: Apache-2.0
"""Intra-op CPU threads: chosen from the cores the process may use (its affinity), one left to the
rest of the machine, split over ranks; an explicit setting wins; every ``vtoken`` command that
runs a model takes ``--threads`` and ``vtoken`` applies it (or the default) before the command."""

from __future__ import annotations

import os

import pytest
import torch

from trtllm_vtoken import threads
from trtllm_vtoken.cli import bench_threads, build_parser, main


@pytest.mark.parametrize("cores,processes,expected", [
    (1, 1, 1), (2, 1, 1), (4, 1, 3), (8, 1, 7), (16, 1, 15), (2, 2, 1), (8, 2, 3), (16, 2, 7), (16, 3, 5),
])
def test_default_threads_leave_one_usable_core_and_split_the_rest(monkeypatch, cores, processes, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(100, 100 + cores)))  # not 0..n-1
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine's count does not matter, the mask does
    assert threads.usable_cores() == cores
    assert threads.default_threads(processes) == expected


def test_set_threads_applies_the_explicit_count_or_the_default(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert threads.set_threads(3) == 3 and torch.get_num_threads() == 3
    assert threads.set_threads() == 2 and torch.get_num_threads() == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            threads.set_threads(bad)


def test_every_command_that_runs_a_model_takes_threads():
    parser = build_parser()
    model_commands = [["generate", "hi"], ["bench", "variants"], ["bench", "quality"], ["bench", "utilization"],
                      ["bench", "overhead"], ["bench", "sweeps"], ["bench", "sla"], ["bench", "sharing"],
                      ["bench", "shift"], ["bench", "serve"], ["bench", "gpu"], ["bench", "threads"]]
    for command in model_commands:
        assert parser.parse_args([*command, "--threads", "3"]).intra_op_threads == 3, command
        assert parser.parse_args(command).intra_op_threads is None, command
    assert parser.parse_args(["bench", "tp", "--threads", "2"]).threads == 2  # threads per rank, default 1
    assert parser.parse_args(["serve", "--threads", "2"]).threads == 2  # a model parameter of the served model
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--threads", "0"])


def test_vtoken_sets_the_threads_before_the_command_runs(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    seen = []
    monkeypatch.setattr(bench_threads, "run_threads", lambda args: seen.append(torch.get_num_threads()) or 0)
    assert main(["bench", "threads", "--threads", "2"]) == 0
    assert main(["bench", "threads"]) == 0
    assert seen == [2, 3]
