# SPDX-License-Identifier: Apache-2.0
"""Decode speed of the real model under CPU contention, per intra-op thread setting.

    for each repeat, in alternating order:
        for each setting (vToken's default, torch's default, an explicit count):
            idle: a fresh process loads the model and times greedy decoding
            busy: the same, while another process spins on one core (``while True: pass``)

Each measurement runs in its own process, so every setting starts from torch's own state (torch's
default is whatever torch picks when nothing sets it). Reported: decode tokens/s (first token to
last, one request), median and range over the repeats, and the busy/idle ratio. Why the default
leaves a core free: ``trtllm_vtoken/threads.py``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trtllm_vtoken.config_base import require_positive

PROMPT = "Explain how a hash table handles collisions, with an example."
SPIN = "while True: pass"


@dataclass(frozen=True)
class ThreadsBenchConfig:
    new_tokens: int = 32
    """Greedy tokens per measurement (EOS ignored)."""
    repeats: int = 3
    threads: int | None = None
    """An explicit thread count measured beside the two defaults."""

    def __post_init__(self) -> None:
        require_positive(self, "new_tokens", "repeats")
        if self.new_tokens < 2:
            raise ValueError("new_tokens must be >= 2 (decode speed is timed from the first token on)")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

    def settings(self) -> list[str]:
        """"default" (trtllm_vtoken.threads), "torch" (torch's own), and the explicit count."""
        return ["default", "torch"] + ([str(self.threads)] if self.threads is not None else [])


def measure(folder: str, setting: str, new_tokens: int) -> dict[str, Any]:
    """In this process: applies ``setting``, loads the model, times one greedy request's decode."""
    import torch

    from trtllm_vtoken.runtime.config import EngineConfig
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.model import load_llama
    from trtllm_vtoken.runtime.sampling import SamplingParams
    from trtllm_vtoken.runtime.tokenizer import Tokenizer
    from trtllm_vtoken.threads import set_threads

    torch_default = torch.get_num_threads()
    if setting == "default":
        set_threads()
    elif setting != "torch":
        set_threads(int(setting))
    prompt = Tokenizer(Path(folder)).encode(PROMPT, chat=True)
    engine = Engine(load_llama(folder), EngineConfig(variant="native", num_blocks=64, max_seq_len=512))
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    while engine.has_unfinished():
        engine.step()
    engine.add_request(prompt, params)
    engine.step()  # the prefill and the first token
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    return {"threads": torch.get_num_threads(), "torch_default_threads": torch_default,
            "tokens_per_s": (new_tokens - 1) / seconds}


def run_threads_bench(cfg: ThreadsBenchConfig, folder: Path, progress=None) -> dict[str, Any]:
    samples: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(cfg.repeats):
        order = cfg.settings() if repeat % 2 == 0 else cfg.settings()[::-1]
        for setting in order:
            for load in ("idle", "busy"):
                samples.setdefault((setting, load), []).append(_measure_in_child(folder, setting, load, cfg))
                if progress is not None:
                    progress.update(1)
    rows = []
    for setting in cfg.settings():
        row: dict[str, Any] = {"setting": setting, "threads": samples[(setting, "idle")][0]["threads"]}
        for load in ("idle", "busy"):
            speeds = [s["tokens_per_s"] for s in samples[(setting, load)]]
            row[load] = {"tokens_per_s": statistics.median(speeds), "min": min(speeds), "max": max(speeds),
                         "runs": speeds}
        row["busy_over_idle"] = row["busy"]["tokens_per_s"] / row["idle"]["tokens_per_s"]
        rows.append(row)
    first = samples[(cfg.settings()[0], "idle")][0]
    return {"config": asdict(cfg), "model": str(folder), "torch_default_threads": first["torch_default_threads"],
            "rows": rows}


def _measure_in_child(folder: Path, setting: str, load: str, cfg: ThreadsBenchConfig) -> dict:
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if load == "busy" else None
    try:
        done = subprocess.run([sys.executable, "-m", __name__, str(folder), setting, str(cfg.new_tokens)],
                              capture_output=True, text=True, check=False)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if done.returncode != 0:
        raise RuntimeError(f"the {setting} / {load} measurement failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # one measurement: <model folder> <setting> <new tokens>
    print(json.dumps(measure(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
