# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import json
import subprocess
import sys

from trtllm_vtoken.cli import main


def test_bench_core_prints_table_and_writes_json(tmp_path, capsys):
    assert main(["bench", "core", "--batch", "8", "--context", "256", "--tokens-per-block", "16",
                 "--steps", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "dense |" in out and "lazy |" in out and "metadata B/token" in out
    data = json.loads((tmp_path / "core.json").read_text())
    modes = [r["config"]["mode"] for r in data["results"]]
    assert modes == ["dense", "lazy"]
    dense = data["results"][0]
    assert dense["moves"] > 0 and 9.0 < dense["metadata_bytes_per_token"] < 12.0


def test_bad_arguments_give_one_line_error(capsys):
    assert main(["bench", "core", "--batch", "0", "--out", "/tmp/unused"]) == 2
    assert capsys.readouterr().err.strip() == "vtoken: error: batch must be positive, got 0"


def test_info_and_import_is_light():
    assert main(["info"]) == 0
    code = "import sys, trtllm_vtoken; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
