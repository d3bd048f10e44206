"""The reference engine on the real model as in ``run.py`` (call beside sampling), in two trees,
each with its own C++ core: the same output tokens? Prints one line per tree with a digest of
every request's output ids, then whether they agree.

    python benchmarks/step/overlap_real/across_commits.py BEFORE_TREE AFTER_TREE
"""

import hashlib
import json
import subprocess
import sys

RUN = """
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
for name in [m for m in sys.modules if m.startswith("trtllm_vtoken")]:
    del sys.modules[name]
sys.path.insert(0, sys.argv[1])
import trtllm_vtoken
assert trtllm_vtoken.__file__.startswith(sys.argv[1])
from trtllm_vtoken.cli.bench_common import load_model
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.workloads import make_workload
_, model, tok = load_model(None)
items = make_workload("sharegpt", 16, tok, seed=0, max_prompt_tokens=256)
e = Engine(model, EngineConfig(policy="h2o", budget=0.5, num_blocks=2048, max_batch_size=16, max_seq_len=400), tok)
ids = [e.add_request(tok.encode(i.prompt, chat=True), SamplingParams(max_tokens=32)) for i in items]
while e.has_unfinished():
    e.step()
print(json.dumps([e.requests[r].output_ids for r in ids]))
"""


def main() -> None:
    digests = {}
    for tree in sys.argv[1:3]:
        out = subprocess.run([sys.executable, "-c", RUN, tree], capture_output=True, text=True, check=True)
        outputs = json.loads(out.stdout.strip().splitlines()[-1])
        digests[tree] = hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]
        print(json.dumps({"tree": tree, "requests": len(outputs), "tokens": sum(map(len, outputs)),
                          "digest": digests[tree]}))
    print(json.dumps({"same_outputs": len(set(digests.values())) == 1}))


if __name__ == "__main__":
    main()
