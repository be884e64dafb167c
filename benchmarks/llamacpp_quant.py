"""Does the served GGUF layout move the depth read on the llama.cpp platform (issue 13's "L_hat within 25 % across
platforms")? The references are written with Q4_1 matrices (``nv.models.reference_family.write_gguf``, the embedded
model's layout); a real model is served as it ships (SmolLM2 Q4_1, the Qwen models Q4_K_M, whose matrices of a row
size not divisible by 256 fall back to Q5_0). Timing depends on the layout's kernels, not on the values, so this
times the params' llama.cpp references and the real targets (the main model and the validation models timed on
llama.cpp) as served and requantised by llama.cpp's own quantiser (``allow_requantize``) to each of ``--types``, each
at the lengths of its run's record, with App. D's protocol and the params' settings. It prints each file's summed
prefill time, then for every pair (references' layout, target's layout) the target's depth across platforms as the
validation reads it (Eq. 9 and Eq. 10, k from those references, setup F) and on llama.cpp alone (beta, alpha fitted
on those references there: no k), and last, per target as served, the range of Eq. 9's depth over the references'
layouts and whether it holds the truth.

Run: python benchmarks/llamacpp_quant.py [--run ROOT] [--work DIR] [--types Q4_1 Q5_0 Q8_0 Q4_K_M] (not in ``make
bench``: ~1-3 min a file here, ~25 files; ``--out DIR`` writes llamacpp_quant.json and llamacpp_quant.png, the grid
of errors per target; ROOT holds a finished ``make repro``'s timing records, default this checkout; files and
records go to --work, default ``.cache/llamacpp_quant``, so a rerun reuses them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from nv.errors import NVError, run_main
from nv.models.loading import gguf_path, load_model
from nv.params import load_params
from nv.phase2.evaluation import held_out
from nv.phase2.platforms import TimedModel, _gguf_for, reference_model, time_platform
from nv.validation import evaluate_timing, load_timing

ROOT = Path(__file__).resolve().parent.parent


def ftype(kind: str) -> int:
    """llama.cpp's file type number of ``kind`` (e.g. Q4_1, Q4_K_M)."""
    import llama_cpp

    number = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}", None)
    if number is None:
        raise NVError(f"llama.cpp has no ftype {kind!r} (e.g. Q4_1, Q5_0, Q8_0, Q4_K_M)")
    return number


def requantise(source: Path, out: Path, kind: str) -> Path:
    """``source`` rewritten by llama.cpp's quantiser as ftype ``kind`` (e.g. Q4_1), written once."""
    import llama_cpp

    if out.is_file():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype(kind), True, 2
    tmp = out.with_suffix(".part")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params) != 0:
        raise NVError(f"llama.cpp could not requantise {source} to {kind}")
    tmp.rename(out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=ROOT, help="project root of a finished make repro")
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "llamacpp_quant")
    parser.add_argument("--types", nargs="*", default=["Q4_1", "Q5_0", "Q8_0", "Q4_K_M"], help="llama.cpp ftypes")
    parser.add_argument("--out", type=Path, help="folder for llamacpp_quant.json and llamacpp_quant.png")
    args = parser.parse_args()

    def work() -> int:
        for kind in args.types:  # a bad one is an error before any model loads
            ftype(kind)
        params = load_params(args.run / "params.yaml")
        timing, family, seed, model = params["timing"], params["timing_family"], params["seed"], params["model"]
        cfg = timing["platforms"]["llamacpp"]
        items = list(params["validation"]["models"])
        out = args.run / "outputs"
        base = load_timing(args.run, items, family, timing["platforms"])
        args.work.mkdir(parents=True, exist_ok=True)
        main_lm = load_model(model["spec"], dtype=model["dtype"], device=model["device"])
        layouts = ["served", *args.types]

        def variants(timed: TimedModel, record: dict) -> dict[str, dict]:
            """``timed`` served as it is and in each of ``--types``, at ``record``'s lengths and trials."""
            served, found = timed.gguf or _gguf_for(timed, seed), {}
            for layout in layouts:
                path = served if layout == "served" else requantise(served, args.work / f"{timed.name}-{layout}.gguf", layout)
                file = args.work / f"{timed.name}-{layout}.json"
                if not file.is_file():
                    timed.gguf = path
                    rec = time_platform(timed, "llamacpp", cfg | {"trials": record["trials"]}, np.array(record["lengths"]),
                                        timing, seed, args.work / f"checkpoint-{timed.name}-{layout}.jsonl")
                    file.write_text(json.dumps(rec | {"gguf": path.name}))
                found[layout] = json.loads(file.read_text())
            timed.gguf = served
            return found

        refs, targets = {}, {}
        for name in cfg["references"]:
            refs[name] = variants(reference_model(name, family[name], main_lm, seed),
                                  json.loads((out / "timing_reference" / name / "llamacpp.json").read_text()))
        folders = {model["spec"]: out / "timing_target"} | {params["validation"]["models"][i]["spec"]: out / "validation_timing" / i
                                                             for i in items}
        for spec, folder in folders.items():
            if not (folder / "llamacpp.json").is_file():
                continue
            record = json.loads((folder / "llamacpp.json").read_text())
            lm = main_lm if spec == model["spec"] else load_model(spec, dtype=model["dtype"], device=model["device"])
            d = record["d_used"]
            targets[spec] = variants(TimedModel(spec, "target", lm, d, timing["kv_ratio"] * d, timing["ffn_ratio"] * d,
                                                int(max(record["lengths"])) + 256, gguf_path(spec)), record)
        seconds = {name: {layout: sum(found[layout]["T"]) for layout in layouts} for name, found in (refs | targets).items()}
        print("summed prefill time over a file's lengths (s):")
        for name, found in (refs | targets).items():
            print(f"  {name:22s} " + "  ".join(f"{layout} {seconds[name][layout]:6.2f} ({found[layout]['gguf']})" for layout in layouts))
        trials = sorted({r["trials"] for found in targets.values() for r in found.values()})
        print("\ndepth (true L): references' layout x target's layout; across platforms basic / Eq. 10, then llama.cpp alone")
        rows = []
        for ref_layout in layouts:
            for spec, found in targets.items():
                for layout in layouts:
                    g = found[layout]
                    llama = [refs[name][ref_layout] for name in cfg["references"]] + [g]
                    table = evaluate_timing(base | {"llamacpp": llama}, timing, trials)
                    row = table[(table.model == spec) & (table.platform == "llamacpp") & (table.setup == "F")
                                & (table.trials == g["trials"])].iloc[0]
                    alone = held_out(llama[:-1], llama[:-1], g, timing, "d_used")
                    rows.append({"references": ref_layout, "model": spec, "layout": layout, "L_true": g["L"],
                                 "across_basic": row.L_hat, "across_eq10": row.L_hat_eq10,
                                 "alone_basic": alone.get("L_hat", np.nan), "alone_eq10": alone.get("L_hat_eq10", np.nan)})
                    err = {k: rows[-1][k] / g["L"] - 1 for k in ("across_basic", "across_eq10", "alone_basic", "alone_eq10")}
                    print(f"  refs {ref_layout:7s} {spec:20s} {layout:7s} (L = {g['L']})  across: {row.L_hat:5.1f} "
                          f"({err['across_basic']:+4.0%}) / {row.L_hat_eq10:5.1f} ({err['across_eq10']:+4.0%})  alone: "
                          f"{rows[-1]['alone_basic']:5.1f} ({err['alone_basic']:+4.0%}) / {rows[-1]['alone_eq10']:5.1f} "
                          f"({err['alone_eq10']:+4.0%})")
        print("\nthe target as served, over the references' layouts (across platforms, Eq. 9): the range an attacker who "
              "times references in every layout would read")
        for spec in targets:
            read = [r["across_basic"] for r in rows if r["model"] == spec and r["layout"] == "served"]
            L = next(r["L_true"] for r in rows if r["model"] == spec)
            low, high = np.nanmin(read), np.nanmax(read)
            print(f"  {spec:20s} L_hat {low:5.1f} to {high:5.1f} for the true {L}: {'inside' if low <= L <= high else 'OUTSIDE'}")
        if args.out:
            write(args.out, layouts, seconds, rows)
        return 0
    return run_main(work)


def write(out: Path, layouts: list[str], seconds: dict, rows: list[dict]) -> None:
    """llamacpp_quant.json (times and depths) and llamacpp_quant.png: per target, the signed error of L_hat across
    platforms (Eq. 9, the validation's basic estimator) over (references' layout, target's layout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "llamacpp_quant.json").write_text(json.dumps({"layouts": layouts, "summed_seconds": seconds, "depths": rows}, indent=1))
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.8 * len(models) + 1.2, 4.8), squeeze=False)
    fig.subplots_adjust(wspace=0.3)
    for n, (ax, model) in enumerate(zip(axes[0], models)):
        err = np.array([[next(r["across_basic"] / r["L_true"] - 1 for r in rows if r["model"] == model
                              and r["references"] == ref and r["layout"] == layout) for layout in layouts] for ref in layouts])
        image = ax.imshow(100 * err, cmap="RdBu_r", vmin=-100, vmax=100)
        for i, j in np.ndindex(err.shape):
            ax.text(j, i, f"{100 * err[i, j]:+.0f} %", ha="center", va="center", fontsize=8,
                    color="white" if abs(err[i, j]) > 0.6 else "black", fontweight="bold" if abs(err[i, j]) <= 0.25 else "normal")
            if i == j and i:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=1.5, ec="k"))
        ax.set_xticks(range(len(layouts)), layouts)
        ax.set_yticks(range(len(layouts)), layouts)
        ax.set_xlabel("target served as")
        if not n:
            ax.set_ylabel("llama.cpp references served as")
        L = next(r["L_true"] for r in rows if r["model"] == model)
        ax.set_title(f"{model} (L = {L})", fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), label="L_hat error across platforms (Eq. 9), %", shrink=0.85)
    fig.suptitle("Depth read through the llama.cpp platform, by served GGUF layout (bold: within 25 %; boxed: both "
                 "requantised alike)\nserved = as the pipeline serves it: references Q4_1 (write_gguf), SmolLM2 Q4_1, "
                 "Qwen Q4_K_M as shipped", fontsize=9)
    fig.savefig(out / "llamacpp_quant.png", dpi=130, bbox_inches="tight")
    print(f"wrote {out / 'llamacpp_quant.json'} and {out / 'llamacpp_quant.png'}")


if __name__ == "__main__":
    sys.exit(main())
