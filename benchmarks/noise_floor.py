"""What limits phase 1's budget (issue 14): the bf16 noise floor under the spectrum of complete blocks of Y.

White-box, one model: the next-token logits z of D random prompts from a float32 forward pass (rank d up to float32
error), the logits a bf16 deployment serves, z_b = bf16(z), and the log-probs at tau, y = log_softmax(z_b / tau) --
the values the sampling API returns for the entries it observes. Columns: the C_max tokens of highest 5th-percentile y
over the first ``--select`` prompts (those every prompt makes likely: what sampling's common set keeps). Prints

- where the columns' logits lie (bf16 spacing 2^(e - 7) in the binade [2^e, 2^(e+1))) and whether z_b - z is the
  uniform rounding error of that spacing (rms / (spacing / sqrt 12) = 1): where the spacing is one value, an i.i.d.
  floor of known scale sigma_e = rms spacing / (tau sqrt 12), which no reweighting of rows, columns or entries lowers;
- per block D' x C (the first D' prompts, the first C columns): the edge ratio R (``nv.phase1.exactness.edge_ratio``),
  the robust estimator's outcome, and sigma_{d-1}, sigma_d, sigma_{d+1} of the row-centred block over the
  Marchenko-Pastur edge of the noise outside the d signal directions (``nv.phase1.exactness.noise_edge``): the
  weakest directions near 1 are at the edge of detectability, far above it they are limited by the block's shape
  only; sigma_{d+1} / edge is where the bulk tops out (~1 for an i.i.d. floor, above 1 for a heteroscedastic one).

With ``--out`` it writes the rows (noise_floor.json) and a figure of sigma_i / edge near i = d per block
(noise_floor.png). Exit 1 if the robust estimator is saturated on a block with a value more than max(3, 0.5 % of d)
off: the honesty bound of issue 14.

Run: python benchmarks/noise_floor.py [--model embedded] [--D 3000] [--blocks 1500x1500,2000x3000,3000x3000,3000x4000,3000x6000]
[--out DIR] (not in ``make bench``: ~5 min for SmolLM2 here). The prompts are random (seeded), not the prompt search's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from nv.oracle import Simulator
from nv.oracle.defence import format_quantum, round_to_format
from nv.oracle.simulator import log_softmax
from nv.params import load_params
from nv.phase1.exactness import edge_ratio, noise_edge
from nv.phase1.search import random_prompts
from nv.phase1.spectrum import centred_singular_values, robust_from_singular_values

from _common import peak_rss, verdict

ROOT = Path(__file__).resolve().parent.parent


def white_box(sim: Simulator, prompts: list[str], tau: float, C_max: int, select: int, batch: int) -> tuple:
    """z, z_b and y of every prompt on the C_max columns chosen from the first ``select`` prompts (streamed in chunks of
    ``batch`` prompts after them: only the chosen columns are kept)."""
    cols, z, z_b, y = None, [], [], []
    start = time.perf_counter()
    edges = [0, *range(select, len(prompts), batch), len(prompts)]  # the first chunk is the ``select`` prompts
    for a, b in zip(edges, edges[1:]):
        z_i = sim.logits(prompts[a:b])
        zb_i = round_to_format(z_i, "bf16")
        y_i = log_softmax(zb_i / tau)
        if cols is None:
            cols = np.argsort(-np.percentile(y_i, 5, axis=0), kind="stable")[:C_max]
        z.append(z_i[:, cols])
        z_b.append(zb_i[:, cols])
        y.append(y_i[:, cols])
        print(f"\r  forward passes {b}/{len(prompts)} ({time.perf_counter() - start:.0f} s)", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return cols, np.concatenate(z), np.concatenate(z_b), np.concatenate(y)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--D", type=int, default=3000)
    ap.add_argument("--tau", type=float, default=2.0)
    ap.add_argument("--blocks", default="1500x1500,2000x3000,3000x3000,3000x4000,3000x6000")
    ap.add_argument("--select", type=int, default=500, help="prompts whose 5th-percentile log-probs choose the columns")
    ap.add_argument("--out", help="folder for noise_floor.json and noise_floor.png")
    args = ap.parse_args()
    blocks = [tuple(int(v) for v in b.split("x")) for b in args.blocks.split(",")]
    if max(D for D, _ in blocks) > args.D:
        ap.error(f"a block has more rows than --D {args.D}")
    params = load_params(ROOT / "params.yaml", ["model", "spectrum"])
    model = {**params["model"], "spec": args.model, "dtype": "float32", "logits": "float32"}
    sim = Simulator.from_params(model)
    d = sim.lm.arch.d
    if min(min(b) for b in blocks) <= d:
        ap.error(f"every block needs more than d = {d} rows and columns")
    prompts = random_prompts(np.random.default_rng(params["seed"]), args.D, 5)
    cols, z, z_b, y = white_box(sim, prompts, args.tau, max(C for _, C in blocks), args.select, 256)
    spacing = format_quantum(z_b, "bf16")
    values, counts = np.unique(spacing, return_counts=True)
    ratio = float(np.sqrt(np.mean((z_b - z) ** 2) / np.mean(spacing**2 / 12)))
    print(f"{args.model}: d = {d}, {args.D} random prompts, the {len(cols)} columns of highest 5th-percentile log-prob (tau = {args.tau})")
    print("  logits there: percentiles 1/50/99 = " + " / ".join(f"{v:.2f}" for v in np.percentile(z_b, [1, 50, 99])))
    share = counts / spacing.size
    print("  bf16 spacing: " + ", ".join(f"{v:g} on {c:.1%}" for v, c in zip(values, share) if c >= 0.01)
          + f" (others {share[share < 0.01].sum():.1%}); rms / median {np.sqrt(np.mean(spacing**2)) / np.median(spacing):.2f}")
    print(f"  rms(z_b - z) / (rms spacing / sqrt 12) = {ratio:.4f}   (1: uniform rounding of that spacing)")
    print(f"{'block':>11} {'R':>6}  {'robust':<18} sigma_(d-1, d, d+1) / edge")
    rows, wrong = [], []
    for D_prime, C in blocks:
        sigma, beta = centred_singular_values(y[:D_prime, :C])
        e = robust_from_singular_values(sigma, beta, **params["spectrum"]["robust"])
        sigma_e = np.sqrt(np.mean(spacing[:D_prime, :C] ** 2) / 12) / args.tau
        edge = noise_edge(sigma_e, D_prime, C, d)
        R = float(edge_ratio(D_prime, C))
        said = f"d_hat_raw = {e.d_hat_raw}" if e.saturated else f"d >= {e.lower_bound}"
        print(f"{D_prime:>5}x{C:<5} {R:6.0f}  {said:<18} " + "  ".join(f"{v:.3f}" for v in sigma[d - 2:d + 1] / edge), flush=True)
        if e.saturated and abs(e.d_hat_raw - d) > max(3, 0.005 * d):
            wrong.append(f"{D_prime} x {C}: saturated at {e.d_hat_raw}, true d = {d}")
        rows.append({"D": D_prime, "C": C, "R": R, "saturated": bool(e.saturated), "d_hat_raw": e.d_hat_raw,
                     "lower_bound": e.lower_bound, "sigma_e": float(sigma_e), "edge": float(edge),
                     "sigma_over_edge": (sigma / edge).tolist()})
    print(f"peak RSS {peak_rss():.2f} GiB")
    if args.out:
        write(Path(args.out), args.model, d, ratio, rows)
    return verdict(wrong)


def write(out: Path, model: str, d: int, ratio: float, rows: list[dict]) -> None:
    """noise_floor.json (the rows) and noise_floor.png: sigma_i / edge against i near d, one line per block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter

    out.mkdir(parents=True, exist_ok=True)
    (out / "noise_floor.json").write_text(json.dumps({"model": model, "d": d, "rounding_ratio": ratio, "blocks": rows}, indent=1))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rows:
        s = np.asarray(r["sigma_over_edge"])
        i = np.arange(max(1, d - 120), min(len(s), d + 80) + 1)
        said = f"d = {r['d_hat_raw']}" if r["saturated"] else f"not saturated, d >= {r['lower_bound']}"
        ax.plot(i, s[i - 1], lw=1.4, label=f"{r['D']} x {r['C']}, R = {r['R']:.0f}: {said}")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(FixedLocator([0.5, 0.7, 1, 1.5, 2, 3, 5, 7, 10, 15, 20, 30, 50]))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.axhline(1, color="k", lw=0.8, ls="--")
    ax.axvline(d, color="grey", lw=0.8, ls=":")
    ax.text(d, 0.97, f" i = d = {d}", va="top", fontsize=8, color="grey", transform=ax.get_xaxis_transform())
    ax.text(ax.get_xlim()[1], 1, "noise edge ", ha="right", va="bottom", fontsize=8)
    ax.set_xlabel("index i")
    ax.set_ylabel("sigma_i / bf16 noise edge")
    ax.set_title(f"{model}: the spectrum's tail against the bf16 floor\n(edge = sigma_e (sqrt(D' - d) + sqrt(C - 1 - d)), "
                 f"sigma_e = rms spacing / (tau sqrt 12))", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(out / "noise_floor.png", dpi=130)
    print(f"wrote {out / 'noise_floor.json'} and {out / 'noise_floor.png'}")


if __name__ == "__main__":
    sys.exit(main())
