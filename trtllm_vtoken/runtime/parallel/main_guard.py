# SPDX-License-Identifier: Apache-2.0
"""Refuse to start rank processes from a script that would start them again in every rank.

Rank processes start with multiprocessing's "spawn" (a fresh interpreter per rank, as CUDA and
gloo need), and a spawned process first re-runs the parent's ``__main__`` module, under the name
``__mp_main__``, to find the rank's entry point. Whatever that module does at its top level runs
again in every rank; only code under ``if __name__ == "__main__":`` does not. The rule checked
here, before anything is spawned:

    __main__ was run from a file (a script, ``python -m``, a console entry point), and the call
    that starts the ranks comes from that file's top-level code at a line outside every
    ``if __name__ == "__main__":`` block      -> RuntimeError, one line naming the idiom

The line is the one the module's top-level frame is executing (``LLM(...)`` itself, or the call
of the function that creates it). What spawn re-runs follows CPython's ``multiprocessing/spawn.py``
(``get_preparation_data``, ``_fixup_main_from_name``, ``_fixup_main_from_path``): a module run
with ``-m`` by its name, a script by its path, never a ``__main__.py`` (``python -m package``).
Interactive sessions, ``python -c`` and notebooks have no file to re-run and pass, as does a
script whose source cannot be read (nothing to check against).
Should a rank re-running the script reach the ranks' start all the same (a script changed under
it), that rank exits at once with the same one-line message instead of multiprocessing's
bootstrapping error.
"""

from __future__ import annotations

import ast
import multiprocessing
import sys
from pathlib import Path

IDIOM = 'if __name__ == "__main__":'


def check_main_guard() -> None:
    """Raises RuntimeError (SystemExit inside a re-running rank) if starting rank processes now
    would start them again in every rank."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        rerunning = getattr(sys.modules.get("__mp_main__"), "__file__", None) or _main_file()
        raise SystemExit(f"vtoken: a rank process re-running {rerunning} reached the start of the ranks at "
                         f"the script's top level: create the LLM under `{IDIOM}`")
    line = unguarded_line()
    if line is not None:
        raise RuntimeError(f"tensor parallelism starts one process per rank with multiprocessing's 'spawn', which "
                           f"re-runs {_main_file()} in each rank: create the LLM under `{IDIOM}` (line {line} "
                           "creates it at the script's top level)")


def unguarded_line() -> int | None:
    """The line of ``__main__``'s file whose top-level code is running this call, if it lies outside
    every ``if __name__ == "__main__":`` block; None otherwise (or when there is no such file)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or not spawn_reruns(main):
        return None
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:  # not called from the module's top-level code (it has finished, or runs elsewhere)
        return None
    try:
        tree = ast.parse(Path(path).read_text(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    guarded = any(node.body[0].lineno <= line <= node.body[-1].end_lineno
                  for node in ast.walk(tree) if isinstance(node, ast.If) and _is_main_test(node.test))
    return None if guarded else line


def spawn_reruns(main) -> bool:
    """Whether a spawned process re-runs the module ``main`` (as multiprocessing decides it)."""
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return name != "__main__" and not name.endswith(".__main__")
    return Path(main.__file__).stem != "__main__"


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"``, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def _main_file() -> str:
    return str(getattr(sys.modules.get("__main__"), "__file__", "the main module"))
