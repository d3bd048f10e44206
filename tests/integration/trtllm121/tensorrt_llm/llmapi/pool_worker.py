# SPDX-License-Identifier: Apache-2.0
"""Plays ``mpi4py.futures.server`` in a spawned worker: extend ``sys.path`` with the client's
(``_sync_set_data``), run the pickled task, send back its result or exception (stdout)."""

import pickle
import sys


def main() -> None:
    task, args, kwargs, path = pickle.loads(sys.stdin.buffer.read())
    sys.path.extend(p for p in path if p not in sys.path)
    try:
        result = (True, task(*args, **kwargs))
    except BaseException as exc:  # the client re-raises it, as a future would
        result = (False, exc)
    sys.stdout.buffer.write(pickle.dumps(result))


if __name__ == "__main__":
    main()
