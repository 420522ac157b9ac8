"""Story: "tp=2 output differs from tp=1". Find the layer, the site and the rank, with `devharness check`.

The bug is planted: `--inject allreduce-drop:layer=1:rank=1` makes rank 1 keep its own partial sum
instead of the all-reduce result of layer 1's attention output -- the kind of bug a sharding change
brings. `devharness check` runs one prompt's prefill and a few decode steps at tp=2 and at tp=1,
compares every layer's attention output, MLP output and residual stream, and names the first site
that parts and the rank to blame. The command it runs is printed; the same without `--inject`
prints "matches tp=1 at every layer" and exits 0.

Exits non-zero unless check names layer 1's attention output on rank 1.
"""
import json
import subprocess
import sys

if __name__ == "__main__":
    cmd = [sys.executable, "-m", "devharness.cli", "check", "--model", "tiny-llama", "--tp", "2",
           "--decode-steps", "2", "--inject", "allreduce-drop:layer=1:rank=1", "--json"]
    print("$ devharness", " ".join(cmd[3:]))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode != 1:   # check exits 1 on a divergence
        sys.exit(f"find_planted_tp_bug: check exited {res.returncode}, not 1:\n{res.stderr[-2000:]}")
    found = json.loads(res.stdout.strip().splitlines()[-1])
    print(found["verdict"])
    if (found["step"], found["layer"], found["site"], found["rank"]) != (0, 1, "attention output", 1):
        sys.exit(f"find_planted_tp_bug: check blamed {found}, not layer 1's attention output on rank 1")
    print("found: the planted bug is rank 1's all-reduce at layer 1")
