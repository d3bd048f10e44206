# SPDX-License-Identifier: Apache-2.0
"""Without the compiled core, the Python specification serves alone and says so."""

from __future__ import annotations

import json

import pytest

from trtllm_vtoken.cli import main
from trtllm_vtoken.core import native


def test_the_python_specification_is_the_fallback_when_the_extension_is_absent(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(native, "load", lambda: None)
    assert native.describe().startswith("python")
    with pytest.raises(RuntimeError, match="not built"):
        native.native_table(4)
    assert main(["bench", "core", "--batch", "4", "--context", "64", "--tokens-per-block", "8", "--steps", "2",
                 "--out", str(tmp_path)]) == 0
    assert "timing the Python core only" in capsys.readouterr().err
    runs = json.loads((tmp_path / "core.json").read_text())["results"]
    assert {r["config"]["impl"] for r in runs} == {"calls", "python"}
