"""nv.phase2.intervals on synthetic estimates (each estimator's split-conformal interval and their hull), and the
validation figures (nv.plots.validation) checked by what they draw."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from nv.phase2.intervals import conformal, hull
from nv.validation import coverage


def test_conformal_half_width_is_the_largest_log_residual_over_the_references_with_a_fit():
    truths = np.array([10.0, 20.0, 30.0])
    assert np.isclose(conformal(np.array([11.0, 18.0, 30.0]), truths), np.log(20 / 18))  # not log(11 / 10)
    # a reference without a fit (or a non-positive one) is left out: the target's own fit succeeded, which the
    # attacker sees, so it is calibrated on the references whose fit did too
    for failed in (np.nan, -0.75, 0.0):
        assert np.isclose(conformal(np.array([11.0, failed, 30.0]), truths), np.log(11 / 10))
    assert conformal(np.array([11.0, np.nan, -1.0]), truths) == np.inf  # one reference with a fit calibrates nothing
    assert conformal(np.array([11.0]), truths[:1]) == np.inf


def test_hull_holds_both_estimators_intervals_and_skips_an_estimator_without_a_fit():
    basic, eq10 = np.array([34.6, 30.0, np.nan, np.nan, 20.0]), np.array([23.2, np.nan, 25.0, np.nan, 22.0])
    q_basic, q_eq10 = np.array([0.2, 0.2, 0.2, 0.2, np.inf]), np.array([0.5, 0.5, 0.5, 0.5, 0.1])
    lo, hi = hull([basic, eq10], [q_basic, q_eq10])
    # both estimates: the lower end is Eq. 10's, the upper end the basic estimator's
    assert np.isclose(lo[0], 23.2 * np.exp(-0.5)) and np.isclose(hi[0], 34.6 * np.exp(0.2))
    # one of them without a fit: the other's own interval
    assert np.isclose(lo[1], 30 * np.exp(-0.2)) and np.isclose(hi[1], 30 * np.exp(0.2))
    assert np.isclose(lo[2], 25 * np.exp(-0.5)) and np.isclose(hi[2], 25 * np.exp(0.5))
    assert np.isnan(lo[3]) and np.isnan(hi[3])  # neither: no interval
    assert (lo[4], hi[4]) == (0.0, np.inf)  # an infinite half-width (fewer than two references with a fit): uninformative
    for x, q in ((basic, q_basic), (eq10, q_eq10)):  # the hull contains every estimator's interval
        ok = np.isfinite(x)
        assert np.all(lo[ok] <= x[ok] * np.exp(-q[ok]) + 1e-12) and np.all(hi[ok] >= x[ok] * np.exp(q[ok]) - 1e-12)


def test_the_hull_covers_a_target_that_only_one_estimator_gets_right():
    """A target of another family: the rule's (basic) estimate is biased by +44 %, Eq. 10's is within 3 % (the
    0.5B's pattern in the README): the rule's interval misses the truth, the hull does not."""
    L_true, basic, eq10, q_basic, q_eq10 = 24.0, 34.6, 23.2, 0.2, 0.5
    assert not basic * np.exp(-q_basic) <= L_true <= basic * np.exp(q_basic)
    lo, hi = hull([np.array([basic]), np.array([eq10])], [np.array([q_basic]), np.array([q_eq10])])
    assert lo[0] <= L_true <= hi[0]


# -- the validation figures (nv.plots.validation): what they draw, on a table of known errors ---------------------


def _lines(ax, marker):
    return [line for line in ax.get_lines() if line.get_marker() == marker and len(line.get_xdata())]


def _legible(fig) -> None:
    """No two visible tick labels of one axis overlap (the issue's overlapping x ticks), on the drawn figure."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            ticks = [*axis.get_major_ticks(), *axis.get_minor_ticks()]
            boxes = [t.label1.get_window_extent(renderer) for t in ticks
                     if t.label1.get_visible() and t.label1.get_text() and lo <= t.get_loc() <= hi]
            assert len(boxes) >= 2 or axis is ax.yaxis, ax.get_title()  # a shared y axis shows its labels once
            assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), (ax.get_title(), axis)


def test_coverage_counts_only_informative_intervals():
    """A lower bound (a budget not saturated: [bound, inf)) and a case without a depth cover nothing: both are counted
    apart as uninformative, not as covered (the lower bounds were 5 of the committed run's "d 7/7"), nor dropped (a
    run whose phase 2 failed kept its coverage)."""
    phase1 = pd.DataFrame({"method": "robust", "d_hi": [np.inf, 580.0, 590.0, np.inf],
                           "covered": [True, True, False, True]})
    cases = pd.DataFrame({"saturated": [True, True, True, False], "L_hat": [30.0, 24.0, np.nan, np.nan],
                          "L_hi": [33.0, 20.0, np.nan, np.nan], "L_covered": [True, False, False, False],
                          "P_hi": [2e8, 6e8, np.nan, np.nan], "P_covered": [True, True, False, False]})
    for suffix in ("", "_rule"):
        cases[f"L_hi{suffix}"], cases[f"P_hi{suffix}"] = cases.L_hi, cases.P_hi
        cases[f"L_lo{suffix}"], cases[f"P_lo{suffix}"] = cases.L_hi / 2, cases.P_hi / 2
        cases[f"L_covered{suffix}"], cases[f"P_covered{suffix}"] = cases.L_covered, cases.P_covered
    cover = coverage(cases, phase1, "robust")
    assert (cover["d"], cover["d_cases"], cover["d_bounds"]) == (0.5, 2, 2)
    assert (cover["L"], cover["L_cases"], cover["P"], cover["P_cases"]) == (0.5, 2, 1.0, 2)
    assert cover["uninformative"] == 2 + 2 and cover["cases"] == 6 and cover["all"] == 4 / 6  # the no-depth case's L, P


def test_d_vs_budget_draws_a_failure_as_a_failure():
    """Fig. validation on two models: saturated budgets at their signed errors, unsaturated ones as red crosses in
    the band above the axes (never on the 0 % line, where a reader takes them for exact), the robust lower bounds
    as triangles at their own errors, the bold signed mean over the models saturated at each N; the two models side by
    side at a shared N (``dodge``: the one's cross no longer hides the other's)."""
    from nv.plots.validation import d_vs_budget, dodge

    colors = {"small": "C0", "wide": "C1"}  # the figures' order of the two models
    small, wide = (lambda *xs, m=m: tuple(dodge(xs, m, colors)) for m in colors)

    rows = []
    for model, d, said in (("small", 576, {10**4: (None, 300), 10**5: (570, None), 3 * 10**5: (576, None)}),
                           ("wide", 896, {10**4: (None, 100), 10**5: (None, 500), 3 * 10**5: (895, None)})):
        for N, (raw, bound) in said.items():
            for method in ("robust", "paper"):
                rows.append({"model": model, "method": method, "N": N, "d_true": d, "d_hat_raw": raw, "lower_bound": bound,
                             "saturated": raw is not None})
    phase1 = pd.DataFrame(rows)
    fig = d_vs_budget(phase1)
    ax = fig.axes[0]
    assert ax.get_title() == "robust estimator"
    points = {tuple(line.get_xdata()): list(line.get_ydata()) for line in _lines(ax, "o")}
    assert points == {small(10**5, 3 * 10**5): [100 * (570 - 576) / 576, 0.0], wide(3 * 10**5): [100 * (895 - 896) / 896]}
    crosses = _lines(ax, "X")
    assert sorted(x for line in crosses for x in line.get_xdata()) == sorted(small(10**4) + wide(10**4, 10**5))
    assert small(10**4) != wide(10**4)
    assert all(y == 115 for line in crosses for y in line.get_ydata())  # in the band above the plotted errors
    assert ax.get_ylim()[0] < 0 < 115 < ax.get_ylim()[1]
    ticks = dict(zip(ax.get_yticks(), (t.get_text() for t in ax.get_yticklabels())))  # the band named on the axis,
    assert ticks[115] == "no estimate" and not [t for t in ax.texts if t.get_text() == "no estimate"]  # not inside it
    assert 100 not in ticks and 50 in ticks  # an error tick as close as 100 would touch the band's label
    bounds = sorted((x, y) for line in _lines(ax, "^") for x, y in zip(line.get_xdata(), line.get_ydata()))  # d >= bound: up
    assert bounds == sorted([(*small(10**4), 100 * (300 - 576) / 576), (*wide(10**4), 100 * (100 - 896) / 896),
                             (*wide(10**5), 100 * (500 - 896) / 896)])
    (mean,) = _lines(ax, "_")
    assert list(mean.get_xdata()) == [10**5, 3 * 10**5]
    assert np.allclose(mean.get_ydata(), [-100 * 6 / 576, -100 * (0 + 1 / 896) / 2])  # signed, as the axis
    assert not _lines(fig.axes[1], "^")  # the paper estimator gives no lower bound
    _legible(fig)


def test_error_vs_budget_figures_put_a_missing_estimate_in_the_band_not_at_zero():
    """Fig. err_d_L_N and Fig. L_param_err_budget: |error| per model at its budgets, a case without an estimate as a
    red cross at FAIL_Y (112 %, the band), the bold mean over the models at their k-th budget (each at its largest K');
    only setup F on the reference platform; the models side by side where their budgets coincide."""
    from nv.plots.validation import FAIL_Y, L_param_err_budget, dodge, err_d_L_N

    colors = {"small": "C0", "wide": "C1"}  # the figures' order of the two models
    small, wide = (lambda *xs, m=m: tuple(dodge(xs, m, colors)) for m in colors)

    rows = []
    for model, errs in (("small", [(None, None, None), (0.0, 0.1, -0.2), (0.0, -0.05, 0.1)]),
                        ("wide", [(None, None, None), (None, None, None), (-0.001, 0.3, 0.2)])):
        for k, (d_err, L_err, P_err) in enumerate(errs):
            for setup, platform in (("F", "inprocess"), ("all", "inprocess"), ("F", "llamacpp")):
                for trials in (2, 5):  # K' = 2 a third worse: the mean takes each model's largest K'
                    scale = 1.5 if trials == 2 else 1.0
                    rows.append({"model": model, "setup": setup, "platform": platform, "N": 10**4 * 10**k,
                                 "tokens": 10.0 ** (9 + k) + trials, "calls": 10.0 ** (7 + k) + trials, "usd": 10.0 ** k,
                                 "trials": trials, "d_err": d_err, "L_err": None if L_err is None else scale * L_err,
                                 "P_err": None if P_err is None else scale * P_err})
    cases = pd.DataFrame(rows).astype({"d_err": float, "L_err": float, "P_err": float})
    fig = err_d_L_N(cases, "inprocess", "robust")
    assert fig.axes[0].get_title() == "hidden dimension d (robust)"
    for ax, what in zip(fig.axes, "dLP"):
        points = {tuple(line.get_xdata()): list(line.get_ydata()) for line in _lines(ax, "s")}  # K' = 5's marker
        mine = cases[(cases.setup == "F") & (cases.platform == "inprocess") & (cases.trials == 5)]
        assert np.allclose(points[small(1e10 + 5, 1e11 + 5)], 100 * mine[mine.model == "small"][f"{what}_err"].abs().iloc[1:])
        assert np.allclose(points[wide(1e11 + 5)], 100 * abs(mine[mine.model == "wide"][f"{what}_err"].iloc[-1]))
        crosses = sorted((x, y) for line in _lines(ax, "X") for x, y in zip(line.get_xdata(), line.get_ydata()))
        assert crosses == sorted((x, FAIL_Y) for x in small(1e9 + 2, 1e9 + 5) + wide(1e9 + 2, 1e9 + 5, 1e10 + 2, 1e10 + 5))
        ticks = dict(zip(ax.get_yticks(), (t.get_text() for t in ax.get_yticklabels())))
        assert ticks[FAIL_Y] == "no estimate" and all(float(v) <= 100 for k, v in ticks.items() if k != FAIL_Y)
        (mean,) = _lines(ax, "_")  # both models' first estimate (1e10 and 1e11) at K' = 5: their mean budget and error
        assert np.allclose(mean.get_xdata(), [(1e10 + 1e11) / 2 + 5])
        assert np.allclose(mean.get_ydata(), 100 * mine[mine[f"{what}_err"].notna()].groupby("model")[f"{what}_err"].first().abs().mean())
    _legible(fig)
    fig = L_param_err_budget(cases, "inprocess", 0.6, "robust")
    assert [ax.get_xlabel() for ax in fig.axes] == ["API calls", "cost (USD at $0.6 per million tokens)"] * 3
    assert [ax.get_ylabel() for ax in fig.axes[::2]] == ["|relative error| of d_hat (robust) (%)"] + [
        f"|relative error| of {w}_hat (%)" for w in "LP"]  # d too, as the paper's
    assert sorted(x for line in _lines(fig.axes[0], "X") for x in line.get_xdata()) == sorted(
        small(1e7 + 2, 1e7 + 5) + wide(1e7 + 2, 1e7 + 5, 1e8 + 2, 1e8 + 5))
    _legible(fig)


def test_the_per_model_error_bars_cut_nothing_off_and_draw_no_fit_as_a_failure():
    """Fig. L_param_err_budget_per_model (a review, 2026-12-07): a bar past the old 150 % top (SmolLM2's attacker-side P
    across platforms, +178 %) was cut off without its value, and a missing estimate was a bar of 0 %. On the symlog axis
    every bar and interval end is inside the axes; no fit is a red cross on the floor and no bar at all."""
    from nv.plots.validation import L_P_errors

    row = {"setup": "F", "model": "m", "calibration": "same platform", "L_true": 30, "P_true": 1e8, "L_hat_basic": 29.0,
           "L_hat_eq10": np.nan, "L_hat": 29.0, "P_hat": 2.78e8, "P_hat_paper": 1.2e8, "P_hat_oracle": 0.9e8,
           "L_lo": 10.0, "L_hi": 60.0, "L_lo_rule": 20.0, "L_hi_rule": 45.0,
           "P_lo": 0.5e8, "P_hi": np.inf, "P_lo_rule": 1e8, "P_hi_rule": 8.2e8}
    fine = {k: (v * 1.05 if isinstance(v, float) and np.isfinite(v) else v) for k, v in row.items()} | {
        "model": "n", "L_hat_eq10": 28.0, "P_hat": 1.1e8, "P_hi": 3e8}  # a second model within the linear part
    fig = L_P_errors(pd.DataFrame([row, fine]))
    (ax,) = fig.axes
    assert ax.get_yscale() == "symlog"
    lo, hi = ax.get_ylim()
    heights = [bar.get_height() for bar in ax.patches]
    assert lo == -100 and max(h for h in heights if np.isfinite(h)) == pytest.approx(178) and hi > 720  # the rule's +720 %
    assert sum(not np.isfinite(h) for h in heights) == 1  # m's missing Eq. 10 L: no bar, not one of 0 %
    (cross,) = _lines(ax, "X")
    assert list(cross.get_ydata()) == [-100]
    assert [t.get_text() for t in ax.texts] == ["to inf"]  # the hull's infinite upper end, written where it leaves
    _legible(fig)


def test_the_overall_figure_writes_out_the_estimates_its_markers_stack():
    """The timing budgets K' add a few tokens to one phase-1 budget, so their markers sit on one another (a review):
    the figure also writes each budget's errors out; a budget without d_hat is a cross in the band, not a line."""
    from nv.plots.overall import error_vs_budget

    rows = [{"N": N, "platform": "inprocess", "trials": K, "phase1_tokens": 1e9 * N / 1e4, "tokens": 1e9 * N / 1e4 + K,
             "d_hat": d_hat, "d_err": d_err, "L_err": L_err, "P_err": P_err}
            for N, d_hat, d_err in ((10_000, None, None), (100_000, 576.0, 0.0), (150_000, 576.0, 0.0))
            for K, L_err, P_err in ((2, 0.1, 0.05), (5, 0.2, -0.03))]
    table = pd.DataFrame(rows).astype({"d_hat": float, "d_err": float})
    table.loc[table.d_hat.isna(), ["L_err", "P_err"]] = np.nan
    table.loc[(table.N == 150_000) & (table.trials == 2), ["L_err", "P_err"]] = np.nan  # a timing budget without a fit
    (ax,) = error_vs_budget(table, "m").axes
    assert [t.get_text() for t in ax.texts if t.get_text().startswith("N =")] == ["\n".join([  # 1.5e+05 is not 2e+05
        "N = 1e+05 (1e+10 tokens + timing): d 0.0 %\n   K' = 2/5: L 10.0 / 20.0 %, P 5.0 / -3.0 %",
        "N = 1.5e+05 (1.5e+10 tokens + timing): d 0.0 %\n   K' = 2/5: L no fit / 20.0 %, P no fit / -3.0 %"])]
    assert sorted(x for line in _lines(ax, "X") for x in line.get_xdata()) == [1e9 + 2, 1e9 + 5]
    _legible(ax.figure)


def test_the_budget_sweep_figure_names_its_no_estimate_band_on_the_axis():
    """validation_budget.png: a budget without an estimate is its estimator's marker in the band, with the reason; the
    band is named by a y tick, where no marker can cover it (the paper detector's '+' at the last budget struck the
    in-band label through; a review), and no error tick sits in it."""
    from nv.plots.phase1 import BAND, budget_sweep

    table = pd.DataFrame([{"tokens": t, "method": m, "d_hat_raw": raw, "rel_error": err, "reason": reason}
                          for t in (1e9, 1e10)
                          for m, raw, err, reason in (("robust", None if t < 1e10 else 576.0, None if t < 1e10 else 0.0,
                                                       "not saturated" if t < 1e10 else "ok"),
                                                      ("paper", None, None, "no saddle"))]).astype({"d_hat_raw": float, "rel_error": float})
    ax = budget_sweep(table, 576).axes[0]
    ticks = dict(zip(ax.get_yticks(), (t.get_text() for t in ax.get_yticklabels())))
    assert ticks[BAND] == "no estimate" and all(float(v) <= 100 for k, v in ticks.items() if k != BAND)
    assert not [t for t in ax.texts if t.get_text() == "no estimate"]
    failed = sorted((line.get_xdata()[0], line.get_marker(), line.get_ydata()[0]) for line in ax.get_lines()
                    if len(line.get_ydata()) == 1 and abs(line.get_ydata()[0] - BAND) <= 10)
    # a row of the band per estimator: their markers at one budget covered each other (a review, 2026-12-07)
    assert failed == [(1e9, "+", BAND), (1e9, "x", BAND + 10), (1e10, "+", BAND)]
    assert sorted(t.get_text() for t in ax.texts) == ["no saddle", "no saddle", "not saturated"]
    _legible(ax.figure)
    # the x axis is labelled at the sweep's budgets (one decade tick named one of four), and the last budget's reason
    # lies inside the axes (it ran into the frame)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1e9", "1e10"] and not ax.xaxis.get_minorticklocs().size
    frame = ax.get_window_extent()
    assert all(frame.x0 <= t.get_window_extent().x0 and t.get_window_extent().x1 <= frame.x1 for t in ax.texts)
    assert ax.get_ylabel().startswith("|relative error|")
    # a wrong estimate 150 % off sits on the 100 line with its value, not in the band or clipped out of the axes
    wrong = pd.concat([table, pd.DataFrame([{"tokens": 1e11, "method": "robust", "d_hat_raw": 1440.0, "rel_error": 1.5,
                                             "reason": "ok"}])], ignore_index=True)
    ax = budget_sweep(wrong, 576).axes[0]
    (robust,) = [line for line in ax.get_lines() if line.get_label() == "robust: d_hat"]
    assert list(robust.get_ydata()) == [0.0, 100.0] and "150 %" in [t.get_text() for t in ax.texts]


def test_phase1_figures_draw_what_a_reader_needs_to_see():
    """A review (2026-12-07): the coverage figure's curve sat flat at 1 up to |C| on a linear axis, and the
    temperature figure wrote its high-entropy prompt as escape codes and showed each prompt alone. Now the coverage
    figure plots the prompts missing each token on a log scale, with the D - D' pruned; the temperature figure writes
    a character its font lacks as a code point and draws the other prompt beside each one."""
    from nv.plots.phase1 import _drawable, coverage as coverage_figure, temperature_entropy

    ax = coverage_figure(np.array([100, 100, 99, 40, 1]), 100, 98, 2).axes[0]
    (curve,) = [line for line in ax.get_lines() if line.get_label() == "prompts that never drew the token"]
    assert list(curve.get_ydata()) == [0, 0, 1, 60, 99] and ax.get_yscale() == "symlog"
    assert [line.get_ydata()[0] for line in ax.get_lines() if "pruned" in line.get_label()] == [2]
    assert _drawable("ab\U0001f701c") == "ab U+1F701 c" and _drawable("What?") == "What?"
    flat, peaked = np.log(np.full(50, 1 / 50)), np.log(np.r_[0.9, np.full(49, 0.1 / 49)])
    fig = temperature_entropy({"high-entropy prompt": ("\U0001f701", [flat, flat]),
                               "low-entropy prompt": ("Paris", [peaked, flat])}, (1.0, 2.0), 10)
    assert fig.axes[0].get_title() == 'high-entropy prompt "U+1F701", T = 1'
    grey = [line for line in fig.axes[0].get_lines() if line.get_label() == "low-entropy prompt at T = 1"]
    assert len(grey) == 1 and grey[0].get_ydata()[0] == pytest.approx(0.9)
    _legible(fig)
