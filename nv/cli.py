"""The ``nv`` command line: ``nv attack --simulate MODEL`` runs phase 1 on a local model.

Every NVError becomes one line on stderr and exit status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nv.errors import NVError
from nv.params import load_params

PHASE1_SECTIONS = ["model", "search", "sampling", "spectrum"]


def _writable(folder: Path) -> Path:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise NVError(f"output folder {folder} is not writable: {exc.strerror}") from None
    return folder


def attack(args: argparse.Namespace) -> int:
    from nv.oracle import Simulator
    from nv.phase1 import run

    params = load_params(args.params, PHASE1_SECTIONS)
    out = _writable(Path(args.out))
    model = {**params["model"], "spec": args.simulate}
    params["model"] = model
    oracle = Simulator.from_params(model)
    record = run(oracle, params, out, args.simulate, d_true=oracle.lm.arch.d, progress=not args.quiet)
    print(json.dumps({k: record[k] for k in ("model", "saturated", "d_hat_raw", "d_hat", "lower_bound", "tokens", "calls")}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nv", description="NightVision: black-box inference of d, L and P.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("attack", help="run the attack and write report.json")
    p.add_argument("--simulate", metavar="MODEL", required=True,
                   help="attack a local model through the simulator: 'embedded', a HF id, a folder or a .gguf file")
    p.add_argument("--params", default="params.yaml", help="params file (sections model, search, sampling, spectrum)")
    p.add_argument("--out", default="attack-out", help="output folder (report.json, spectrum.png, checkpoints)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        return attack(args)
    except NVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished work is checkpointed; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
