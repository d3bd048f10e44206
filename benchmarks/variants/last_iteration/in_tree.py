"""Runs a script with the package of another tree (a ``git worktree`` of an older commit) imported
instead of this checkout's editable install; without the tree's own built C++ core its step runs
the Python core, whose results the parity tests hold equal.

    python benchmarks/variants/last_iteration/in_tree.py TREE SCRIPT [ARGS...]
"""

import runpy
import sys

tree, script = sys.argv[1], sys.argv[2]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
for name in [m for m in sys.modules if m.startswith("trtllm_vtoken")]:
    del sys.modules[name]
sys.path.insert(0, tree)
import trtllm_vtoken  # noqa: E402

if not trtllm_vtoken.__file__.startswith(tree):
    raise SystemExit(f"imported {trtllm_vtoken.__file__}, not the tree {tree}")
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
