"""
The miniature ScaleRL study: ScaleRL and the paper's variants trained on the embedded toy-hard task
under torchrun (1 generator + 1 trainer rank, PipelineRL-8 unless the variant says otherwise), every
run's sigmoid fitted, and a report of which of the paper's findings the miniature reproduces.

    python study.py runs/study              # every variant x its seeds; resumes (a finished run is kept)
    python study.py runs/study --report     # only fit the runs there and write the report
    python study.py runs/study --quick      # 2 variants x 1 seed x a few steps: the test's form

Writes runs/study/report.md (and report.json, the same numbers), study.png (pass rate vs
device-seconds, seed-averaged, with the fits) and study_extrap.png (each variant fitted on the first
half of its compute, extrapolated to its end).

The readings:
- Compute is device-seconds (training wall-clock x the 2 processes, idle time included, as the paper's
  GPU-hours count idle GPUs; evals excluded): the findings and figures use it. FLOPs (estimated) get a
  table of their own; they cannot show an idle rank, so the off-policy finding is read in seconds only.
- The runs train float32 weights (the CPU's native type), where the float32 head changes nothing; the
  precision finding is read on a bf16 pair: bf16 weights with and without the float32 head.
- Per variant: A is the mean (and spread) of its seeds' own fits; B and C_mid come from the paper's
  comparison rule: every run refitted with A fixed to the mean A of all runs, B averaged over seeds.
- Extrapolation test, every run: fit on the points with C <= half its compute, predict R at its last
  point; the report counts the runs that land within 0.02. Predictability is reproduced when at least half
  of the checked runs land within it, not reproduced when under a third do, and inconclusive in between or
  when no run could be checked (too few points in every first half).
- A finding compares the variant the paper expects to be better (X) with the other (Y). The seed margin
  on A is max(0.02, sd_X + sd_Y) (the paper's 0.02, or the seeds' own spread if larger); on B it is
  sd_X + sd_Y of the per-seed B. "A": X's A above Y's by more than the margin -> reproduced, below by
  more -> not reproduced, else inconclusive. "B": similar A (within the margin) and a higher B. "A or B":
  a higher A, or a similar A and a higher B (the leave-one-out reading: the choice is kept because
  ScaleRL is at least as good). "early": X's seed-averaged pass rate is higher at a quarter of the
  shortest run's compute.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from data import read_jsonl
from fit import (NOISE_A, check_points, extrapolation_check, fit_sigmoid, fit_start, load_run, plot, sigmoid)

TASK = ["--data", "toy-hard", "--think_budget", "32", "--eval_every", "5", "--save_every", "0", "--eval_samples", "4"]
VARIANTS = {  # name: (train.py flags on top of ScaleRL's defaults, seeds)
    "scalerl": ([], 3),
    "ppo_offpolicy": (["--mode", "ppo_offpolicy"], 2),
    "sync": (["--mode", "sync"], 2),
    "loss_dapo": (["--loss", "dapo"], 2),
    "loss_grpo": (["--loss", "grpo"], 2),
    "bf16": (["--dtype", "bfloat16"], 2),  # bf16 weights, float32 head (ScaleRL's precision on GPUs)
    "bf16_no_fp32_head": (["--dtype", "bfloat16", "--no-fp32_head"], 2),
    "agg_sample": (["--agg", "sample"], 2),
    "adv_prompt": (["--adv_norm", "prompt"], 2),
    "no_zero_var": (["--no-zero_var_filter"], 2),
    "no_npr": (["--no-no_positive_resampling"], 2),
    "length_penalty": (["--length_control", "penalty"], 2),
    "batch8": (["--prompts", "8"], 2),
    "batch32": (["--prompts", "32"], 2),
}
FINDINGS = [  # (finding, the paper's claim, X = expected better, Y, rule)
    ("off-policy algorithm", "PipelineRL-8 and PPO-off-policy-8 reach a similar A; PipelineRL has the higher B "
     "(Fig. 4a)", "scalerl", "ppo_offpolicy", "B"),
    ("off-policy algorithm", "PipelineRL-8 vs the synchronous loop: the same reading", "scalerl", "sync", "B"),
    ("loss type", "CISPO reaches a higher A than DAPO (Fig. 5a)", "scalerl", "loss_dapo", "A"),
    ("loss type", "CISPO reaches a higher A than GRPO-style clipping (Fig. 5a)", "scalerl", "loss_grpo", "A"),
    ("FP32 head", "with bf16 weights, the float32 LM head raises A (Fig. 5b: 0.52 -> 0.61)", "bf16",
     "bf16_no_fp32_head", "A"),
    ("batch size", "a larger batch (32 vs 16 prompts) lifts A (section 5)", "batch32", "scalerl", "A"),
    ("batch size", "a smaller batch (8 vs 16 prompts) looks better early (section 5)", "batch8", "scalerl", "early"),
    ("zero-variance filtering", "ScaleRL with it is at least as good as without", "scalerl", "no_zero_var", "A or B"),
    ("No-Positive-Resampling", "ScaleRL with it is at least as good as without", "scalerl", "no_npr", "A or B"),
    ("length control", "interruptions are at least as good as a length penalty", "scalerl", "length_penalty", "A or B"),
    ("loss aggregation", "prompt-level is at least as good as sample-level", "scalerl", "agg_sample", "A or B"),
    ("advantage normalization", "batch-level is at least as good as prompt-level", "scalerl", "adv_prompt", "A or B"),
]

# -----------------------------------------------------------------------------
# training the runs


def run_dir(out, name, seed):
    return os.path.join(out, f"{name}-s{seed}")


def finished(path, steps):
    """A run is finished when its metrics hold the eval of its last step."""
    try:
        records = read_jsonl(os.path.join(path, "metrics.jsonl"))
        return any(r.get("kind") == "eval" and r.get("step") == steps for _, r in records)
    except (OSError, ValueError):
        return False


def train_all(out, variants, steps, extra=(), ranks=2):
    """Train every (variant, seed) not finished yet: torchrun with `ranks` processes, one run at a time."""
    here = os.path.dirname(os.path.abspath(__file__))
    todo = [(n, s) for n, (_, seeds) in variants.items() for s in range(seeds) if not finished(run_dir(out, n, s), steps)]
    t0 = time.time()
    for i, (name, seed) in enumerate(todo):
        path = run_dir(out, name, seed)
        print(f"study: [{i + 1}/{len(todo)}] {name} seed {seed} -> {path} ({(time.time() - t0) / 60:.1f} min so far)",
              flush=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               os.path.join(here, "train.py"), "--out", path, "--overwrite", "--seed", str(seed), "--steps", str(steps),
               *TASK, *extra, *variants[name][0]]
        with open(os.path.join(out, f"{name}-s{seed}.log"), "w") as log:
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode:
                sys.exit(f"study: {name} seed {seed} failed; its log: {log.name}")

# -----------------------------------------------------------------------------
# fitting and judging


def seed_average(runs):
    """The seeds' curves averaged at their common evals -> (C, R)."""
    n = min(len(r[0]) for r in runs)
    return np.mean([r[0][:n] for r in runs], 0), np.mean([r[1][:n] for r in runs], 0)


def analyze(out, variants, compute):
    """Fit every run in one compute unit -> {variant: dict(runs=[per-run dict], A, A_sd, B, B_sd, C_mid, ...)}
    plus the shared A of the comparison rule."""
    fits = {}
    for name, (_, seeds) in variants.items():
        runs = []
        for s in range(seeds):
            C, R, _ = load_run(run_dir(out, name, s), compute)
            C, R = check_points(C, R)
            runs.append(dict(seed=s, C=C, R=R, fit=fit_sigmoid(C, R), extrap=extrapolation_check(C, R)))
        fits[name] = runs
    shared_A = float(np.mean([r["fit"]["A"] for runs in fits.values() for r in runs]))
    table = {}
    for name, runs in fits.items():
        for r in runs:
            r["refit"] = fit_sigmoid(r["C"], r["R"], R0=r["fit"]["R0"], A=shared_A)
        A = [r["fit"]["A"] for r in runs]
        B = [r["refit"]["B"] for r in runs]
        C_avg, R_avg = seed_average([(r["C"], r["R"]) for r in runs])
        table[name] = dict(runs=runs, A=float(np.mean(A)), A_sd=float(np.std(A)), B=float(np.mean(B)),
                           B_sd=float(np.std(B)), C_mid=float(np.mean([r["refit"]["C_mid"] for r in runs])),
                           R0=float(np.mean([r["fit"]["R0"] for r in runs])), R_last=float(R_avg[-1]),
                           C_last=float(C_avg[-1]), curve=(C_avg, R_avg))
    return table, shared_A


def judge(x, y, rule, table):
    """One finding: 'reproduced', 'not reproduced' or 'inconclusive', and the numbers behind it."""
    a, b = table[x], table[y]
    dA, margin_A = a["A"] - b["A"], max(NOISE_A, a["A_sd"] + b["A_sd"])
    dB, margin_B = a["B"] - b["B"], a["B_sd"] + b["B_sd"]
    similar = abs(dA) <= margin_A
    why = f"A {a['A']:.3f} vs {b['A']:.3f} (margin {margin_A:.3f}); B {a['B']:.2f} vs {b['B']:.2f} (margin {margin_B:.2f})"
    if rule == "early":
        C_q = 0.25 * min(a["C_last"], b["C_last"])
        ra, rb = (float(np.interp(C_q, *t["curve"])) for t in (a, b))
        why = f"pass rate at C = {C_q:.3g}: {ra:.3f} vs {rb:.3f} (margin {NOISE_A})"
        return ("reproduced" if ra - rb > NOISE_A else "not reproduced" if rb - ra > NOISE_A else "inconclusive"), why
    if rule == "A":
        verdict = "reproduced" if dA > margin_A else "not reproduced" if dA < -margin_A else "inconclusive"
    elif rule == "B":
        verdict = ("reproduced" if similar and dB > margin_B else
                   "not reproduced" if not similar or dB < -margin_B else "inconclusive")
    else:  # "A or B"
        verdict = ("reproduced" if dA > margin_A or (similar and dB > margin_B) else
                   "not reproduced" if dA < -margin_A or (similar and dB < -margin_B) else "inconclusive")
    return verdict, why

# -----------------------------------------------------------------------------
# the report


def variant_rows(table):
    rows = ["| variant | flags | seeds | A mean | A sd | B (shared A) | B sd | C_mid (shared A) | R0 | R last |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in table.items():
        flags = " ".join(VARIANTS.get(name, ([], 0))[0]) or "(ScaleRL)"
        rows.append(f"| {name} | `{flags}` | {len(t['runs'])} | {t['A']:.3f} | {t['A_sd']:.3f} | {t['B']:.2f} | "
                    f"{t['B_sd']:.2f} | {t['C_mid']:.3g} | {t['R0']:.3f} | {t['R_last']:.3f} |")
    return rows


def extrapolation_rows(table):
    rows = ["| run | fitted on C <= | points | predicted at the end | measured | error |", "|---|---|---|---|---|---|"]
    for name, t in table.items():
        for r in t["runs"]:
            x = r["extrap"]
            rows.append(f"| {name}-s{r['seed']} | " + (f"{x['C_half']:.3g} | {x['n']} | {x['predicted']:.3f} | "
                        f"{x['measured']:.3f} | {x['error']:+.3f} |" if x else "too few points | | | | |"))
    return rows


def extrapolation_count(table):
    errors = [r["extrap"]["error"] for t in table.values() for r in t["runs"] if r["extrap"]]
    return sum(abs(e) <= NOISE_A for e in errors), len(errors)


def judge_predictability(within, n):
    """The predictability finding from `within` of `n` checked runs landing within 0.02: reproduced for at
    least half, not reproduced for under a third, else (and when no run could be checked) inconclusive."""
    if not n:
        return "inconclusive", "no run could be checked: none has enough points in its first half to fit"
    verdict = "reproduced" if within * 2 >= n else "not reproduced" if within * 3 < n else "inconclusive"
    return verdict, f"{within} of {n} runs within 0.02"


def write_report(out, variants, steps, elapsed=None):
    """Fit every run (device-seconds and FLOPs), judge the findings, write report.md / report.json and the
    two figures -> the report's text."""
    table, shared_A = analyze(out, variants, "compute_s")
    table_f, shared_A_f = analyze(out, variants, "flops")
    found = [(f, claim, x, y, rule, *judge(x, y, rule, table)) for f, claim, x, y, rule in FINDINGS
             if x in table and y in table]
    within, n = extrapolation_count(table)
    found.append(("predictability", "a fit on the first half of the compute predicts the end within 0.02",
                  "", "", "", *judge_predictability(within, n)))
    runs = sum(len(t["runs"]) for t in table.values())
    lines = [f"# The miniature ScaleRL study: {len(table)} variants, {runs} runs of {steps} steps on toy-hard", "",
             f"Written by `python study.py {out}`" + (f" ({elapsed / 60:.0f} min of training on this machine)."
                                                    if elapsed else "."), "",
             "## The paper's findings", "", "| finding | the paper | here | numbers (device-seconds) |",
             "|---|---|---|---|"]
    lines += [f"| {f} | {claim} | **{v}** | {why} |" for f, claim, _, _, _, v, why in found]
    lines += ["", f"## Per variant, compute in device-seconds (shared A = {shared_A:.3f})", ""]
    lines += variant_rows(table)
    lines += ["", f"## Per variant, compute in FLOPs (shared A = {shared_A_f:.3f})", ""] + variant_rows(table_f)
    lines += ["", f"## Extrapolation test (device-seconds): {within} of {n} runs within 0.02", ""]
    lines += extrapolation_rows(table)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    numbers = {name: {k: v for k, v in t.items() if k not in ("runs", "curve")} | {"runs": [
        {"seed": r["seed"], "fit": r["fit"], "refit": r["refit"], "extrap": r["extrap"],
         "C_last": float(r["C"][-1]), "R_last": float(r["R"][-1])} for r in t["runs"]]} for name, t in table.items()}
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump({"shared_A": shared_A, "variants": numbers, "extrapolation_within": [within, n],
                   "findings": [dict(zip(("finding", "claim", "x", "y", "rule", "verdict", "why"), row)) for row in found]},
                  f, indent=1)
    draw(out, table)
    return text


def draw(out, table):
    """study.png: the seed-averaged curves and their fits; study_extrap.png: each fitted on its first half."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pooled = []
    for name, t in table.items():
        C, R = t["curve"]
        pooled.append(dict(run=name, C=C, R=R, used=(C > 0) & (C >= fit_start(C)), data=(C, R), fit=fit_sigmoid(C, R),
                           compute="compute_s", metric="held-out pass rate (mean@4)"))
    plot(pooled, os.path.join(out, "study.png"), os.path.join(out, "study_linear.png"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (name, t) in enumerate(table.items()):
        C, R = t["curve"]
        x = extrapolation_check(C, R)
        ax.scatter(C[C > 0], R[C > 0], s=8, color=f"C{k % 10}", alpha=0.6)
        if x:
            half = fit_sigmoid(C[C <= x["C_half"]], R[C <= x["C_half"]])
            grid = np.geomspace(C[C > 0][0], C[-1], 100)
            ax.plot(grid, sigmoid(grid, half["A"], half["B"], half["C_mid"], half["R0"]), "--", color=f"C{k % 10}",
                    label=f"{name}: predicted {x['predicted']:.3f}, measured {x['measured']:.3f}")
            ax.axvline(x["C_half"], color=f"C{k % 10}", lw=0.5, alpha=0.4)
    ax.set(xscale="log", xlabel="compute (device-seconds: training wall-clock x processes)",
           ylabel="held-out pass rate", title="fitted on the first half of each curve's compute (before the line)")
    if ax.get_legend_handles_labels()[0]:  # none when no run had enough points in its first half
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "study_extrap.png"), dpi=90)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description="The miniature ScaleRL study on the toy-hard task.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", help="the study's folder (one sub-folder per run)")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps per run")
    p.add_argument("--report", action="store_true", help="only fit the runs in the folder and write the report")
    p.add_argument("--quick", action="store_true", help="2 variants x 1 seed x 10 tiny steps (the test's form)")
    args = p.parse_args(argv)
    variants, extra, steps = VARIANTS, [], args.steps
    if args.quick:
        variants = {"scalerl": ([], 1), "loss_dapo": (["--loss", "dapo"], 1)}
        extra, steps = ["--prompts", "4", "--samples", "4", "--val_size", "16", "--eval_every", "2",
                        "--eval_samples", "1"], 10
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    if not args.report:
        train_all(args.out, variants, steps, extra)
    print(write_report(args.out, variants, steps, None if args.report else time.time() - t0))
    print(f"wrote {args.out}/report.md, report.json, study.png, study_extrap.png")


if __name__ == "__main__":
    main()
