"""Print (or write) SHA-256 digests of the inputs that the first cases of the CPU sweep
materialise. The committed digests (tests/data/input_hashes.json) were made with torch 2.13 on
x86-64; tests/test_input_hashes.py checks that another machine or torch version rebuilds the
same bits, which is what "a case file replays bit-exactly everywhere" rests on.

    python scripts/input_hashes.py --write tests/data/input_hashes.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch
from flashcheck.verify.strategies import fixed_sweep

N_CASES = 12


def digest(inputs) -> str:
    h = hashlib.sha256()
    for name in ("query", "key", "value", "attn_mask", "grad_out"):
        t = getattr(inputs, name)
        if t is None:
            h.update(name.encode() + b":none")
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool
                 else t.to(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def compute() -> dict:
    cases = fixed_sweep("cpu")[:N_CASES]
    return {c.to_json(): digest(c.materialize("cpu")) for c in cases}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", metavar="PATH")
    args = ap.parse_args(argv)
    d = {"torch": torch.__version__, "digests": compute()}
    if args.write:
        with open(args.write, "w") as f:
            json.dump(d, f, indent=1, sort_keys=True)
    else:
        print(json.dumps(d, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
