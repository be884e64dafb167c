"""More references on the llama.cpp platform: does a wider F^tgt move the cross-platform depth (issue 13's "L_hat
within 25 % across platforms")? Times the named references of params.yaml's ``timing_family`` on ``llamacpp`` only
(App. D's protocol, params' settings), beside a finished run's other timing records, then re-evaluates the
validation's timing cases (references F, the target's platform llama.cpp) with the params' llama.cpp references and
with the wider set. Also prints each model's own transfer factor k_i = gamma_i(llamacpp) / gamma_i(inprocess) (Eq. 8
on one model, the fits of Eqs. 6-7 on its own points): the pooled k of Eq. 8 is their weighted mean, and a target whose
k_i sits below it reads shallow.

Run: python benchmarks/llamacpp_references.py [--run ROOT] [--work DIR] [REF ...] (not in ``make bench``: ~2 min a
reference here; ROOT is a project root whose ``outputs/`` hold a finished ``make repro``'s timing records, default this
checkout; the records are copied to --work, default ``.cache/llamacpp_references``, and new ones written there, so a
rerun reuses them). Default REFs: every reference of ``timing_family`` the params do not time on llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from nv.errors import NVError, run_main
from nv.models.loading import load_model
from nv.params import load_params
from nv.phase2.evaluation import regime
from nv.phase2.fit import fit_gamma, transfer_factor
from nv.phase2.platforms import reference_model, time_platform
from nv.validation import evaluate_timing, load_timing

ROOT = Path(__file__).resolve().parent.parent


def own_k(folder: Path, discard: int) -> tuple[float, float]:
    """(k_i, L) of the model whose records are in ``folder``: its own gamma on llama.cpp over its own in process."""
    gamma = {}
    for platform in ("inprocess", "llamacpp"):
        record = json.loads((folder / f"{platform}.json").read_text())
        ell, T, sigma = regime(record, discard)
        gamma[platform] = fit_gamma(np.full(len(ell), float(record["d"])), ell, T, sigma).slope
    return transfer_factor(gamma["llamacpp"], gamma["inprocess"]), record["L"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("refs", nargs="*", help="references of timing_family to time on llama.cpp")
    parser.add_argument("--run", type=Path, default=ROOT, help="project root of a finished make repro")
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "llamacpp_references")
    args = parser.parse_args()

    def work() -> int:
        params = load_params(args.run / "params.yaml")
        timing, family, seed = params["timing"], params["timing_family"], params["seed"]
        cfg = timing["platforms"]["llamacpp"]
        extra = args.refs or [name for name in family if name not in cfg["references"]]
        unknown = sorted(set(extra) - set(family))
        if unknown:
            raise NVError(f"not in timing_family: {unknown}")
        items = list(params["validation"]["models"])
        outputs = args.work / "outputs"
        for sub in ["timing_reference", "timing_target"] + [f"validation_timing/{item}" for item in items]:
            if not (outputs / sub).is_dir():
                if not (args.run / "outputs" / sub).is_dir():
                    raise NVError(f"{args.run / 'outputs' / sub}: no timing records there (run make repro first)")
                shutil.copytree(args.run / "outputs" / sub, outputs / sub, ignore=shutil.ignore_patterns("*.ipynb", "*.png"))
        target = load_model(params["model"]["spec"], dtype=params["model"]["dtype"], device=params["model"]["device"])
        for name in extra:
            out = outputs / "timing_reference" / name / "llamacpp.json"
            if not out.is_file():
                timed = reference_model(name, family[name], target, seed)
                lengths = timed.lengths(cfg["r"], timing["n_lengths"], timing["discard"] + 2)
                record = time_platform(timed, "llamacpp", cfg, lengths, timing, seed, args.work / f"checkpoint-{name}.jsonl")
                out.write_text(json.dumps(record))
        print("each model's own k_i = gamma(llamacpp) / gamma(inprocess):")
        folders = {name: outputs / "timing_reference" / name for name in cfg["references"] + extra}
        folders |= {params["model"]["spec"]: outputs / "timing_target"}
        folders |= {item: outputs / "validation_timing" / item for item in items}
        for name, folder in folders.items():
            k, L = own_k(folder, timing["discard"])
            print(f"  {name:20s} L = {L:3d}  k_i = {k:5.1f}")
        for refs in (cfg["references"], cfg["references"] + extra):
            platforms = timing["platforms"] | {"llamacpp": cfg | {"references": refs}}
            table = evaluate_timing(load_timing(args.work, items, family, platforms), timing | {"platforms": platforms},
                                    sorted({r["trials"] for r in params["validation"]["models"].values()} | {cfg["trials"]}))
            table = table[(table.setup == "F") & (table.platform == "llamacpp")]
            print(f"\nllama.cpp references: {', '.join(refs)} (the rule's references' median errors: basic "
                  f"{table.median_ref_err_basic.iloc[0]:.0%}, Eq. 10 {table.median_ref_err_eq10.iloc[0]:.0%})")
            for row in table.itertuples():
                print(f"  {row.model:20s} K' = {row.trials:2d}  basic {row.L_hat:5.1f} ({row.L_hat / row.L_true - 1:+.0%})  "
                      f"Eq. 10 {row.L_hat_eq10:5.1f} ({row.L_hat_eq10 / row.L_true - 1:+.0%})  true {row.L_true}")
        return 0
    return run_main(work)


if __name__ == "__main__":
    sys.exit(main())
