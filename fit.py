"""
Fit ScaleRL's compute-performance curve (arXiv 2510.13786, Eq. 1) to a run's eval pass rates:

    R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B)     A ceiling, B efficiency, C_mid half-gain

Start at fit_sigmoid (the paper's grid, section 2, polished by curve_fit); compare: the +-0.02 rule.

    python fit.py runs/cpu          # table, runs/cpu/fit_device_s.png, its _linear.png, curves.png
    python fit.py runs/a runs/b --fit_until 600 --extrapolate_to 5000 --png out/ab.png
    python fit.py runs/gpu --compute flops --fit_from 1e15 --metric pass_rate/math
"""
import argparse
import itertools
import math
import os
import sys

import numpy as np
from scipy.optimize import curve_fit

from faults import printable
from runs import read_jsonl
from plots import TRAIN_SERIES, color, draw_curves, figure_name, pyplot, save_figure

FIT_FROM = 0.1       # x the largest C
MIN_POINTS = 4
A_STEP = 0.005
NOISE_A = 0.02       # noise in A
N_CMID = 100
CMID_BEYOND = 10.0
B_RANGE = (0.05, 20.0)
GOLDEN_ITERS = 25
WARP_MAX = 1.5       # device-seconds per FLOP


def sigmoid(C, A, B, C_mid, R0):
    """Pass rate at compute C (C = 0 gives R0)."""
    C = np.asarray(C, dtype=float)
    with np.errstate(divide="ignore", over="ignore"):
        return R0 + (A - R0) / (1.0 + (C_mid / C) ** B)


def power_law(C, A, B, D):
    return A - D * np.asarray(C, dtype=float) ** -B


def check_points(C, R, lines=None):
    """(C, R) as float arrays, checked."""
    C, R = np.asarray(C, dtype=float).ravel(), np.asarray(R, dtype=float).ravel()
    if C.shape != R.shape:
        raise ValueError(f"C and R differ in length: {len(C)} vs {len(R)}")
    at = [f"point {i}" for i in range(len(C))] if lines is None else [f"line {n}" for n in lines]
    bad = np.flatnonzero(~(np.isfinite(C) & np.isfinite(R)))
    if len(bad):
        raise ValueError(f"NaN or inf at {at[bad[0]]}: C={C[bad[0]]}, R={R[bad[0]]}")
    if len(C) and C.min() < 0:
        raise ValueError(f"negative compute at {at[np.argmin(C)]}: C={C.min()}")
    down = np.flatnonzero(np.diff(C) <= 0)
    if len(down):
        i = down[0]
        raise ValueError(f"compute must strictly increase: C={C[i]} at {at[i]}, "
                         f"then C={C[i + 1]} at {at[i + 1]}")
    return C, R


def fit_start(C, fit_from=None):
    """fit_from, or FIT_FROM of the largest C."""
    return FIT_FROM * float(np.max(C, initial=0.0)) if fit_from is None else fit_from


def fit_points(C, R, R0=None, fit_from=None):
    """The points a fit uses -> (C, R, R0)."""
    C, R = check_points(C, R)
    if R0 is None:
        if not len(C) or C[0] != 0:
            raise ValueError("R0 not given and no point at C = 0 to read it from; pass R0=")
        R0 = R[0]
    start = fit_start(C, fit_from)
    keep = (C > 0) & (C >= start)
    if keep.sum() < MIN_POINTS:
        where = "with C > 0" + (f" and C >= {start:g} (fit_from)" if start else "")
        raise ValueError(f"need at least {MIN_POINTS} points {where} to fit, got {keep.sum()}")
    return C[keep], R[keep], float(R0)


def golden_min(f, lo, hi, shape):
    """Elementwise golden-section minimum of f over [lo, hi]."""
    g = (math.sqrt(5) - 1) / 2
    lo, hi = np.full(shape, float(lo)), np.full(shape, float(hi))
    x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
    f1, f2 = f(x1), f(x2)
    for _ in range(GOLDEN_ITERS):
        left = f1 < f2
        hi, lo = np.where(left, x2, hi), np.where(left, lo, x1)
        x_new = np.where(left, hi - g * (hi - lo), lo + g * (hi - lo))
        f_new = f(x_new)
        x1, x2 = np.where(left, x_new, x2), np.where(left, x1, x_new)
        f1, f2 = np.where(left, f_new, f2), np.where(left, f1, f_new)
    return np.where(f1 < f2, x1, x2), np.minimum(f1, f2)


def best_B(C, R, R0, A, C_mid):
    """The lowest-SSE B for every (A, C_mid) pair -> B, sse."""
    L = np.log(C_mid)[:, None] - np.log(C)                      # (m, n) log(C_mid / C)
    gain = (A - R0)[:, None, None]                              # (a, 1, 1)

    def sse(log_b):                                             # (a, m) -> (a, m)
        with np.errstate(over="ignore"):
            u = np.exp(np.exp(log_b)[..., None] * L)            # (a, m, n) (C_mid / C)**B
        return ((R - R0 - gain / (1.0 + u)) ** 2).sum(-1)

    log_b, sse_min = golden_min(sse, *np.log(B_RANGE), (len(A), len(C_mid)))
    return np.exp(log_b), sse_min


def polish(C, R, R0, A, B, C_mid, fix_A):
    """curve_fit from a grid point, kept where it fails."""
    def model(c, *p):
        return sigmoid(c, A if fix_A else p[0], p[-2], math.exp(p[-1]), R0)

    k = int(fix_A)
    lo, hi = [R0, B_RANGE[0], -np.inf][k:], [1.0, B_RANGE[1], np.inf][k:]
    p0 = np.clip([A, B, math.log(C_mid)][k:], lo, hi)
    try:
        p, _ = curve_fit(model, C, R, p0=p0, bounds=(lo, hi))
    except RuntimeError:
        return A, B, C_mid
    return (A if fix_A else float(p[0])), float(p[-2]), math.exp(p[-1])


def flat_series(C, R, R0=None, fit_from=None):
    """Why the fitted points are flat (never NOISE_A above R0), or None."""
    C, R, R0 = fit_points(C, R, R0, fit_from)
    if R.max() - R0 >= NOISE_A:
        return None
    return (f"a flat series: the {len(R)} points fitted never rise {NOISE_A} above R0 = {R0:.3f} "
            f"(their highest is {R.max():.3f}), so there is no curve to fit (A, B and C_mid would "
            "be arbitrary)")


def fit_sigmoid(C, R, R0=None, fit_from=None, A=None):
    """The paper's fit; A given: held fixed."""
    C, R, R0 = fit_points(C, R, R0, fit_from)
    if A is None:
        lo = max(np.floor((R.max() - NOISE_A) / A_STEP) * A_STEP, R0 + A_STEP)
        A_grid = np.arange(lo, 1.0 + 1e-9, A_STEP)
        if not len(A_grid):
            raise ValueError(
                f"pass rates must lie in [0, 1], got R0 = {R0:g} and max R = {R.max():g}"
                if max(R0, R.max()) > 1 else f"R0 = {R0} leaves no room for a ceiling A <= 1")
    else:
        A_grid = np.array([float(A)])
    M_grid = np.geomspace(C[0], C[-1] * CMID_BEYOND, N_CMID)
    B_grid, sse = best_B(C, R, R0, A_grid, M_grid)             # (a, m), (a, m)
    i, j = np.unravel_index(np.argmin(sse), sse.shape)
    A, B, C_mid = polish(C, R, R0, A_grid[i], B_grid[i, j], M_grid[j], fix_A=A is not None)
    sse = float(((R - sigmoid(C, A, B, C_mid, R0)) ** 2).sum())
    return dict(A=float(A), B=B, C_mid=C_mid, R0=R0, sse=sse)


def power_D(C, R, A, B):
    """Least-squares D for each (A, B)."""
    X = C ** -B[:, None]                                        # (a, n)
    return ((A[:, None] - R) * X).sum(1) / (X ** 2).sum(1)


def fit_power_law(C, R, R0=None, fit_from=None):
    """R = A - D / C**B on fit_sigmoid's points, for comparison."""
    C, R, R0 = fit_points(C, R, R0, fit_from)
    A = np.arange(np.floor(R.max() / A_STEP + 1) * A_STEP, 1.0 + 1e-9, A_STEP)
    A = A if len(A) else np.array([R.max() + A_STEP])          # (a,)

    def sse(log_b):                                             # (a,) -> (a,)
        B = np.exp(log_b)
        D = power_D(C, R, A, B)
        return ((R - power_law(C, A[:, None], B[:, None], D[:, None])) ** 2).sum(1)

    log_b, sse_min = golden_min(sse, math.log(1e-3), math.log(B_RANGE[1]), len(A))
    i = int(np.argmin(sse_min))
    B = math.exp(log_b[i])
    D = float(power_D(C, R, A[i:i + 1], np.array([B]))[0])
    return dict(A=float(A[i]), B=B, D=D, R0=R0, sse=float(sse_min[i]))


def linear_view(R, A, B, C_mid, R0):
    """log F(R): B log C on the curve, NaN outside (R0, A)."""
    R = np.asarray(R, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return B * math.log(C_mid) - np.log((A - R0) / (R - R0) - 1.0)


def bootstrap_A(C, R, R0=None, fit_from=None, n=50, seed=0):
    """Spread of A over refits with resampled residuals."""
    fit = fit_sigmoid(C, R, R0, fit_from)
    C, R, R0 = fit_points(C, R, fit["R0"], fit_from)
    pred = sigmoid(C, fit["A"], fit["B"], fit["C_mid"], R0)    # (n_points,)
    rng = np.random.default_rng(seed)
    A = np.array([fit_sigmoid(C, pred + rng.choice(R - pred, len(R)), R0, fit_from=0)["A"]
                  for _ in range(n)])
    lo, hi = np.percentile(A, [2.5, 97.5])
    return dict(mean=float(A.mean()), std=float(A.std()), lo=float(lo), hi=float(hi))


def compare(fit_a, fit_b, data_a, data_b, fit_from=None, tol=NOISE_A):
    """The +-0.02 rule on A, then B."""
    dA = fit_b["A"] - fit_a["A"]
    if abs(dA) >= tol:
        better = "b" if dA > 0 else "a"
        return dict(branch="different", dA=dA, better=better,
                    verdict=f"A differs by {abs(dA):.3f} >= {tol}: {better} has the higher ceiling")
    A = (fit_a["A"] + fit_b["A"]) / 2
    ra = fit_sigmoid(*data_a, R0=fit_a["R0"], fit_from=fit_from, A=A)
    rb = fit_sigmoid(*data_b, R0=fit_b["R0"], fit_from=fit_from, A=A)
    better = "b" if rb["B"] > ra["B"] else "a"
    return dict(branch="noise", dA=dA, A_shared=A, B_a=ra["B"], B_b=rb["B"],
                C_mid_a=ra["C_mid"], C_mid_b=rb["C_mid"], better=better,
                verdict=f"A within noise (|dA| = {abs(dA):.3f} < {tol}); refit with shared A = "
                        f"{A:.3f}: B {ra['B']:.2f} vs {rb['B']:.2f}, {better} is more efficient")


def shared_A_refit(runs, fit_from=None):
    """Section 4: every run refitted with their mean A."""
    A = float(np.mean([r["fit"]["A"] for r in runs]))
    return A, [fit_sigmoid(*r["data"], R0=r["fit"]["R0"], fit_from=fit_from, A=A) for r in runs]


def extrapolation_check(C, R, R0=None, fit_from=None):
    """Fit the first half of the compute, predict the last point."""
    C, R = check_points(C, R)
    half = C <= C[-1] / 2
    try:
        f = fit_sigmoid(C[half], R[half], R0, fit_from)
    except ValueError:
        return None
    predicted = float(sigmoid(C[-1], f["A"], f["B"], f["C_mid"], f["R0"]))
    return dict(C_half=C[-1] / 2, n=int(half.sum()), predicted=predicted, measured=float(R[-1]),
                error=predicted - float(R[-1]))


def predict_final(C, R, C_end, R0=None):
    """train.py's live prediction at C_end, or None."""
    C, R = check_points(C, R)
    if ((C > 0) & (C >= fit_start(C))).sum() < MIN_POINTS or flat_series(C, R, R0):
        return None
    f = fit_sigmoid(C, R, R0)
    R_end = float(sigmoid(C_end, f["A"], f["B"], f["C_mid"], f["R0"]))
    return dict(A=f["A"], B=f["B"], C_mid=f["C_mid"], R_end=R_end)


def eval_point(rec, compute, metric, where):
    """(C, R) of one eval line, checked."""
    missing = [k for k in (compute, metric) if k not in rec]
    if missing:
        raise ValueError(f"{where}: eval line: missing field '{missing[0]}' (it has {sorted(rec)})")
    C, R = (checked_number(rec, k, where) for k in (compute, metric))
    if not 0 <= R <= 1:
        raise ValueError(f"{where}: field '{metric}' must be a pass rate in [0, 1], "
                         f"got {rec[metric]!r}")
    return C, R


def finite(v):
    """v is a finite number (not a boolean)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def checked_number(rec, key, where):
    """rec[key] as a float, or ValueError 'WHERE: ...'."""
    if key not in rec:
        raise ValueError(f"{where}: missing field '{key}'")
    v = rec[key]
    if not finite(v):
        text = repr(v) if len(repr(v)) < 40 else f"{repr(v)[:20]}... ({len(repr(v))} characters)"
        raise ValueError(f"{where}: field '{key}' must be a finite number, got {text}")
    return float(v)


def metrics_file(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not found (is {run_dir} a run directory of train.py?)")
    return path


def load_run(run_dir, compute="compute_s", metric="pass_rate"):
    """Eval lines of run_dir/metrics.jsonl -> C, R, meta."""
    path = metrics_file(run_dir)
    C, R, lines, config = [], [], [], {}
    for lineno, rec in read_jsonl(path):
        if rec.get("kind") == "config":
            config = rec
        elif rec.get("kind") == "eval":
            c, r = eval_point(rec, compute, metric, f"{path}:{lineno}")
            C.append(c)
            R.append(r)
            lines.append(lineno)
    try:
        C, R = check_points(C, R, lines)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    name = os.path.basename(os.path.normpath(run_dir))
    return C, R, dict(run=name, path=path, config=config, compute=compute, metric=metric)


# ----------------------------------------------------------------------------- training curves

def number(rec, key):
    """rec[key] as a float, or None."""
    v = rec.get(key)
    return float(v) if finite(v) else None


def train_curves(run_dir):
    """The series curves.png draws -> {name: (steps, values)}."""
    points = {k: [] for k in (*TRAIN_SERIES, "kept", "eval_pass_rate")}
    for _, rec in read_jsonl(metrics_file(run_dir), follow=False):
        step, kind = number(rec, "step"), rec.get("kind")
        if step is None or kind not in ("train", "eval"):
            continue
        if kind == "eval":
            values = {"eval_pass_rate": number(rec, "pass_rate")}
        else:
            kept, prompts = number(rec, "kept_prompts"), number(rec, "prompts")
            values = {k: number(rec, k) for k in TRAIN_SERIES}
            values["kept"] = kept / prompts if kept is not None and prompts else None
        for k, v in values.items():
            if v is not None:
                points[k].append((step, v))
    return {k: tuple(np.array(p, dtype=float).reshape(-1, 2).T) for k, p in points.items()}


def plot_curves(run_dir):
    png = os.path.join(run_dir, "curves.png")
    return draw_curves(train_curves(run_dir), png, os.path.basename(os.path.normpath(run_dir)))


# ----------------------------------------------------------------------------- command line

def fit_run(run_dir, args):
    """Load and fit one run as the flags say."""
    C, R, meta = load_run(run_dir, args.compute, args.metric)
    head = C <= (np.inf if args.fit_until is None else args.fit_until)
    try:
        flat = flat_series(C[head], R[head], fit_from=args.fit_from)
        if flat:
            raise ValueError(flat)
        fit = fit_sigmoid(C[head], R[head], fit_from=args.fit_from)
        power = fit_power_law(C[head], R[head], fit_from=args.fit_from)
    except ValueError as e:
        raise ValueError(f"{meta['path']}: {e}") from None
    used = head & (C > 0) & (C >= fit_start(C[head], args.fit_from))
    warp = unit_warp(run_dir, args.metric, C, used) if args.compute == "compute_s" else None
    return dict(meta, C=C, R=R, used=used, data=(C[head], R[head]), fit=fit, power=power,
                warp=warp)


def unit_warp(run_dir, metric, C, used):
    """Max over min device-seconds per FLOP over the points used, or None."""
    try:
        F = load_run(run_dir, "flops", metric)[0]
    except ValueError:
        return None
    ratio = C[used] / F[used]
    return float(ratio.max() / ratio.min())


UNITS = {"compute_s": "device-seconds: training wall-clock x processes, evals excluded",
         "flops": "FLOPs, estimated: 2 x params per generated or prefilled token "
                  "+ 6 x params per trained token"}


def print_table(runs, args):
    """One row per run, like the paper's Table 1."""
    cols = f"{'run':<16} {'A':>6} {'B':>5} {'C_mid':>9} {'R0':>6} {'fit range':>19} "
    cols += f"{'last C':>9} {'R meas':>7} {'R pred':>7} {'R power':>7}"
    if args.extrapolate_to:
        cols += f" {'R @ ' + format(args.extrapolate_to, '.3g'):>10}"
    print(cols)
    for run in runs:
        f, p, C = run["fit"], run["power"], run["C"]
        params = (f["A"], f["B"], f["C_mid"], f["R0"])
        span = f"{C[run['used']][0]:.3g}..{C[run['used']][-1]:.3g}"
        row = f"{run['run']:<16} {f['A']:6.3f} {f['B']:5.2f} {f['C_mid']:9.3g} {f['R0']:6.3f} "
        row += f"{span:>19} {C[-1]:9.3g} {run['R'][-1]:7.3f} {sigmoid(C[-1], *params):7.3f} "
        row += f"{power_law(C[-1], p['A'], p['B'], p['D']):7.3f}"
        if args.extrapolate_to:
            row += f" {sigmoid(args.extrapolate_to, *params):10.3f}"
        print(row)
    print(f"C in {UNITS.get(runs[0]['compute'], runs[0]['compute'])}; A ceiling, B steepness, "
          "C_mid compute at half the gain, R0 pass rate at C = 0; fit range: the C fitted; "
          "R meas / R pred / R power: measured, sigmoid and power law at the last C")


def plot(runs, png, png_linear, extrapolate_to=None):
    """The fit figure (png) and its linear view (png_linear)."""
    plt = pyplot()
    (fig, ax), (fig_lin, ax_lin) = plt.subplots(figsize=(6, 4)), plt.subplots(figsize=(6, 4))
    for k, run in enumerate(runs):
        f, C, R, used, col = run["fit"], run["C"], run["R"], run["used"], color(plt, k, len(runs))
        rest, params = (C > 0) & ~used, (f["A"], f["B"], f["C_mid"], f["R0"])
        F = np.exp(linear_view(R, *params))
        name = f"{run['run']}: B={f['B']:.2f}"
        curve = f"{name} A={f['A']:.3f} C_mid={f['C_mid']:.3g}"
        for a, y, label in ((ax, R, curve), (ax_lin, F, name)):
            a.scatter(C[used], y[used], s=12, color=col, label=label)
            a.scatter(C[rest], y[rest], s=12, facecolors="none", edgecolors=col)
        x = np.geomspace(C[used][0], C[used][-1], 200)
        ax.plot(x, sigmoid(x, *params), color=col)
        ax_lin.plot(x, x ** f["B"], color=col)
        x = np.geomspace(C[used][-1], max(C[-1], extrapolate_to or 0.0), 100)
        ax.plot(x, sigmoid(x, *params), "--", color=col)
        ax_lin.plot(x, x ** f["B"], "--", color=col)
        ax.axhspan(f["A"] - NOISE_A, f["A"] + NOISE_A, color=col, alpha=0.12, lw=0)
    unit = UNITS.get(runs[0]["compute"], runs[0]["compute"])
    ax.set(xscale="log", xlabel=f"compute C ({unit})", ylabel=runs[0]["metric"])
    ax_lin.set(xscale="log", yscale="log", xlabel=f"compute C ({unit})",
               ylabel="F(R) = C_mid^B / ((A - R0)/(R - R0) - 1)")
    for fig_, ax_, path in ((fig, ax, png), (fig_lin, ax_lin, png_linear)):
        save_figure(fig_, ax_, path, len(runs))
        plt.close(fig_)


def main(argv=None):
    p = argparse.ArgumentParser(description="Fit the ScaleRL sigmoid to runs' eval pass rates.")
    p.add_argument("run_dirs", nargs="*", help="run directories holding metrics.jsonl")
    p.add_argument("--fit_from", type=float, default=None, help="drop points with C below this "
                   "(the early transient); default None = 10%% of the largest C fitted "
                   "(the paper's practice); 0 keeps every point with C > 0")
    p.add_argument("--fit_until", type=float, default=None, help="fit only points with C <= this "
                   "and extrapolate to the rest; default None fits every point")
    p.add_argument("--extrapolate_to", type=float, default=None, help="also predict and draw "
                   "the curve up to this compute; default None stops at the last point")
    p.add_argument("--compute", choices=("compute_s", "flops"), default="compute_s",
                   help="which compute field of the eval lines is C")
    p.add_argument("--metric", default="pass_rate", help="eval field to fit, e.g. pass_rate/math")
    p.add_argument("--png", default=None, help="figure file; the straight-line view goes next to "
                   "it with a _linear suffix; default None means fit_UNIT.png in the first run "
                   "dir (fit_device_s.png, fit_flops.png; the metric added when it is not "
                   "pass_rate)")
    args = p.parse_args(argv)
    if not args.run_dirs:
        p.error("give run directories (each holding a metrics.jsonl)")
    # before the fit
    curves = [plot_curves(d) for d in args.run_dirs]
    try:
        runs = [fit_run(d, args) for d in args.run_dirs]
    except ValueError:
        print(printable(f"wrote {', '.join(curves)}; the fit failed:"), file=sys.stderr)
        raise
    print_table(runs, args)
    for run in runs:
        if run["warp"] and run["warp"] > WARP_MAX:
            print(f"warning: {run['run']}: its device-seconds per FLOP vary {run['warp']:.2f}x "
                  f"over the points fitted (over {WARP_MAX}x: the machine's speed changed), so "
                  "a device-second fit bends; fit --compute flops instead (docs/reference.md, "
                  "'The log, the alarms and the fits')")
        x = extrapolation_check(*run["data"], fit_from=args.fit_from)
        print(f"{run['run']}: extrapolation check: "
              + (f"fitted on C <= {x['C_half']:.3g} ({x['n']} points), "
                 f"predicted {x['predicted']:.3f} at the last point, "
                 f"measured {x['measured']:.3f}, error {x['error']:+.3f}"
                 if x else "too few points in the first half of the compute to fit"))
    for a, b in itertools.combinations(runs, 2):
        v = compare(a["fit"], b["fit"], a["data"], b["data"], fit_from=args.fit_from)
        print(f"{a['run']} (a) vs {b['run']} (b): {v['verdict']}")
    if len(runs) > 2:
        A, refits = shared_A_refit(runs, args.fit_from)
        print(f"all runs with the shared A = {A:.3f} (their mean): " + ", ".join(
            f"{r['run']} B {f['B']:.2f} C_mid {f['C_mid']:.3g}" for r, f in zip(runs, refits)))
    png = args.png or os.path.join(args.run_dirs[0], figure_name(args.compute, args.metric))
    root, ext = os.path.splitext(png)
    png_linear = root + "_linear" + (ext or ".png")
    plot(runs, png, png_linear, args.extrapolate_to)
    print(f"wrote {png}, {png_linear} and the training curves {', '.join(curves)}")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as err:
        # one line, not a traceback
        sys.exit(printable(f"error: {err}"))
    except SystemExit as err:  # runs.py's lines quote paths
        sys.exit(printable(err.code) if isinstance(err.code, str) else err.code)
