"""
The miniature ScaleRL study: ScaleRL and the paper's variants trained on the embedded toy-hard task,
3 seeds each, every run's sigmoid fitted (arXiv 2510.13786, Eq. 1), and a report of which of the
paper's findings the miniature reproduces, with the margin that decided each.

    python study.py runs/study                   # the variants in priority order,
                                                   within --budget; resumes
    python study.py runs/study --assets assets   # also copy study_report.json and the figures there
    python study.py runs/study --report          # only fit the runs there and write the report
    python study.py runs/study --quick           # 3 variants x 1 seed x a few steps:
                                                   the test's form

Writes runs/study/report.md, study_report.json ({"runs", "findings", "minutes", ...}), study.png
(pass rate vs FLOPs, seed-averaged, with the fits) and study_extrap.png (each run fitted on the
first half of its compute, extrapolated to its end).

The design, and why:
- Two loops. The findings about the off-policy algorithm (PipelineRL-8 vs PPO-off-policy-8 vs sync)
  and about the loss run under torchrun, 1 generator + 1 trainer rank, PipelineRL-8 unless the
  variant says otherwise ("pipelinerl" is ScaleRL there). The losses need it: one process takes one
  optimizer step per batch with the weights that sampled it, every importance ratio is 1, and CISPO,
  DAPO and GRPO take the same step (DAPO and GRPO one-process runs were identical eval for eval).
  Every other finding compares one-process runs (ScaleRL's choices in the synchronous loop,
  "scalerl"), two at a time with one torch thread each: on 2 cores that is 1.4x the runs per hour of
  torchrun (58 s against 41.5 s a run for 40 steps, measured), and it takes the off-policy lag out
  of comparisons that are not about it.
- One task, one held-out set. The problems are toy-hard's chains of 2 to 4 operations (MAX_OPS),
  drawn once with a fixed seed and split once (problems/train.jsonl, problems/val.jsonl): TRAIN
  (1500) training prompts, so that 200 steps of 16 serve each about twice and No-Positive-Resampling
  has retired prompts to skip (with all 7,013 none came back, and the no-NPR runs equalled ScaleRL's
  eval for eval); every run
  is evaluated on the same 2000 held-out prompts x 1 sample (the paper: 1000 x 16), so runs differ
  by their seed's curriculum and sampling noise, not by which prompts they were scored on. Each eval
  logs its standard error over the prompts (pass_rate_se: the spread of the per-prompt means /
  sqrt(prompts), about 0.005 at a pass rate of 0.95). One sample of 2000 prompts costs what two of
  1000 do, and its standard error is lower (0.011 against 0.015 measured at 0.5): the prompts differ
  more than two samples of one prompt do.
- A task whose curves the half-compute test can predict. The test (fit the first half, predict the
  last eval within 0.02) fails on curves that wobble about their trend, however long the run: on
  toy-hard's full 2 to 6 operations the evals wander 0.012-0.019 about each run's own fit (their
  sd; consecutive evals correlated 0.2-0.7), and exact sigmoids given that wobble are predicted
  within 0.02 in only 28-82% of simulated runs (BENCHMARKS.md section 9). The 300-step study on
  that task predicted 21 of 45 runs; larger batches, higher learning rates and a 32-token budget
  (whose hard corner no sigmoid fits) did not help. On chains of at most 4 operations ScaleRL's
  evals wobble ~0.006, bend by step 100 (0.93) and creep to ~0.96 at step 200, at 2 machine-minutes
  a run. The price: the ceiling sits near 1 (fitted A ~0.99), so differences in A are squeezed under
  it and most findings are read on efficiency (B, C_mid).
  lr 2e-4, 200 steps, an eval every 10 (a first half holds 10 evals, 8 of them past the fit's
  start at 10% of its compute).
- Length control that acts. The base model thinks 13/19/25 tokens for 2/3/4 operations, and in a
  fifth of its traces checks its work, which doubles them (27/39/51). --think_budget 32 cuts those
  checks (~14% of held-out samples interrupted at step 0; the chains themselves fit, so the ceiling
  stays the model's); the length-penalty variant gets the same total, --l_max 48 (32 + 16: the
  penalty from 42 tokens on, -1 past 48), under the same generation budget. With a 64-token
  thinking budget neither ever acted. The answer budget stays 64: with 16, one of 3 ScaleRL seeds
  wrote past it after </think>, its truncated samples got no gradient, and it collapsed
  (BENCHMARKS.md section 9).
- Units. Findings about the off-policy algorithm (PipelineRL-8 vs PPO-off-policy-8 vs the
  synchronous loop) are about wall-clock, so they are fitted in device-seconds (training wall-clock
  x the 2 processes, idle ranks included as the paper's GPU-hours count idle GPUs; evals excluded).
  Every other finding, the extrapolation test and the figures use FLOPs (estimated from the tokens),
  which do not move with the machine's load. Efficiency is read as a higher B or a lower C_mid at a
  similar A: the paper's Fig. 4a names B, but in Eq. 1 a run that spends a constant factor more
  compute per step (an idle rank) is the same curve moved along log C, which is C_mid, not B.
- The float32 runs make the float32 LM head a no-op, so the precision finding is read on a bf16
  pair: bf16 weights (AdamW on float32 master copies) with and without the float32 head.
- Per variant: A is the mean (and sd) of its seeds' own fits; B and C_mid come from the paper's
  comparison rule: every run refitted with A fixed to the mean A of all runs, B averaged over seeds.
- Margin of a finding on A: the largest of 0.02 (the paper's), the seeds' spread sd_X + sd_Y, and
  the eval's own noise, 2 x sqrt(se_X^2 / n_X + se_Y^2 / n_Y) with se the runs' last-eval standard
  error. On B: sd_X + sd_Y of the per-seed B; on C_mid: sd_X + sd_Y of the per-seed log10 C_mid (at
  least 0.02). "A": X's A above Y's by more than the margin -> reproduced, below by more -> not
  reproduced, else inconclusive. "efficiency": a similar A and a higher B or a lower C_mid (and not
  the other way on either) -> reproduced; a different A, or only worse -> not reproduced. "A or B":
  a higher A, or a similar A and a higher B (a leave-one-out: the paper keeps the choice, so ScaleRL
  must be at least as good). "early": X's seed-averaged pass rate is higher at a quarter of the
  compute, by more than the eval margin (at least 0.02).
- Collapse: a run whose last eval is more than COLLAPSE_DROP below its own best has collapsed; it is
  reported apart and left out of the extrapolation test (a collapse is a finding, not noise).
- Extrapolation (the paper's predictability test), every run that did not collapse: fit on the
  points with C <= half its compute, predict its last eval, report the error. Predictability is
  reproduced when at least 80% of the checked runs land within 0.02, not reproduced under half, else
  inconclusive.
- Budget: the variants run in the order of VARIANTS, and a variant starts only if its runs fit in
  what is left of --budget machine-minutes (a run's wall-clock x its share of the cores; the study
  folder's finished runs count, so a resumed study keeps to the same budget) at the pace measured so
  far for runs of its kind; the report names the variants left out.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

import numpy as np

from data import read_jsonl, toy_model_dir, toy_problems
from fit import (NOISE_A, check_points, color, extrapolation_check, fit_sigmoid, fit_start,
                 load_run, plot, save_figure, sigmoid)

SEEDS = 3
HELD_OUT = 2000       # held-out prompts, the same for every run
TRAIN = 1500          # training prompts: 200 steps x 16 serve each about twice (NPR retires some)
MAX_OPS = 4           # the study's problems: toy-hard's chains of 2 to 4 operations (docstring)
# a last eval this far below the run's best: collapsed (about 4 standard errors of an eval)
COLLAPSE_DROP = 0.05
# a run's wobble: the sd of its evals about its own fit from 30% of its compute on
WOBBLE_FROM = 0.3
STEPS = 200
TASK = ["--think_budget", "32", "--lr", "2e-4", "--eval_every", "10", "--eval_samples", "1",
        "--save_every", "0"]
# the study's runs (assets/study_report.json) were made before the negative-side mask became
# train.py's default; with it off they reproduce
PINS = ["--neg_trust", "0"]
# name: train.py flags on top of ScaleRL's defaults; the order is the priority under --budget (the
# paper names the off-policy algorithm, the loss and the precision the most important choices; the
# findings read on A alone, the bf16 pair and batch32, come last: under this task's ceiling near 1
# their differences in A are squeezed, and they cost the most)
VARIANTS = {
    "scalerl": [],  # one process: the synchronous loop, one policy version per batch
    "batch8": ["--prompts", "8"],
    "length_penalty": ["--length_control", "penalty", "--l_max", "48"],  # 32 + 16 (docstring)
    "pipelinerl": [],  # ScaleRL as the paper runs it: PipelineRL-8 over generator and trainer ranks
    "loss_dapo": ["--loss", "dapo"],
    "loss_grpo": ["--loss", "grpo"],
    "ppo_offpolicy": ["--mode", "ppo_offpolicy"],
    "no_npr": ["--no-no_positive_resampling"],
    "no_zero_var": ["--no-zero_var_filter"],
    "sync": ["--mode", "sync"],
    "agg_sample": ["--agg", "sample"],
    "adv_prompt": ["--adv_norm", "prompt"],
    "bf16": ["--dtype", "bfloat16"],  # bf16 weights, float32 head (ScaleRL's precision on GPUs)
    "bf16_no_fp32_head": ["--dtype", "bfloat16", "--no-fp32_head"],
    "batch32": ["--prompts", "32"],
}
# torchrun, 1 generator + 1 trainer, PipelineRL-8 unless the flags say otherwise: the findings about
# the off-policy algorithm, and the losses, which differ only off-policy (one update per batch with
# the sampling weights makes every ratio 1, so CISPO, DAPO and GRPO take the same step; measured:
# DAPO and GRPO one-process runs were identical eval for eval)
RANKS = {"pipelinerl", "loss_dapo", "loss_grpo", "ppo_offpolicy", "sync"}
# how they run torchrun: every socket on 127.0.0.1 (README, "Generator and trainer ranks"): a file
# rendezvous (run_command names it beside the run's folder), no store hosted by the launcher
LOOPBACK_TORCHRUN = ["--rdzv-backend", "c10d", "--rdzv-conf", "store_type=file",
                     "--local-addr", "127.0.0.1"]
LOOPBACK_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# one-process runs side by side, one core (one torch thread) each; a torchrun run takes both
PARALLEL = 2
FINDINGS = [  # (finding, the paper's claim, X = expected better, Y, rule, compute unit)
    ("off-policy algorithm", "PipelineRL-8 and PPO-off-policy-8 reach a similar A; PipelineRL is "
     "more efficient, a higher B (Fig. 4a)",
     "pipelinerl", "ppo_offpolicy", "efficiency", "compute_s"),
    ("off-policy algorithm", "PipelineRL-8 vs the synchronous loop: the same reading",
     "pipelinerl", "sync", "efficiency", "compute_s"),
    ("loss type", "CISPO reaches a higher A than DAPO (Fig. 5a)",
     "pipelinerl", "loss_dapo", "A", "flops"),
    ("loss type", "CISPO reaches a higher A than GRPO-style clipping (Fig. 5a)",
     "pipelinerl", "loss_grpo", "A", "flops"),
    ("FP32 head", "with bf16 weights, the float32 LM head raises A (Fig. 5b: 0.52 -> 0.61)",
     "bf16", "bf16_no_fp32_head", "A", "flops"),
    ("batch size", "a larger batch (32 vs 16 prompts) lifts A (section 5)",
     "batch32", "scalerl", "A", "flops"),
    ("batch size", "a smaller batch (8 vs 16 prompts) looks better early (section 5)",
     "batch8", "scalerl", "early", "flops"),
    ("zero-variance filtering", "ScaleRL with it is at least as good as without",
     "scalerl", "no_zero_var", "A or B", "flops"),
    ("No-Positive-Resampling", "ScaleRL with it is at least as good as without",
     "scalerl", "no_npr", "A or B", "flops"),
    ("length control", "interruptions are at least as good as a length penalty",
     "scalerl", "length_penalty", "A or B", "flops"),
    ("loss aggregation", "prompt-level is at least as good as sample-level",
     "scalerl", "agg_sample", "A or B", "flops"),
    ("advantage normalization", "batch-level is at least as good as prompt-level",
     "scalerl", "adv_prompt", "A or B", "flops"),
]
UNIT_NAMES = {"compute_s": "device-seconds", "flops": "FLOPs"}
QUICK_NOTE = ("QUICK STUDY: a few tiny steps per run, to test the machinery; these numbers mean "
              "nothing.")

# -----------------------------------------------------------------------------
# the problems and the runs


def make_problems(out, held_out=HELD_OUT):
    """out/problems/{train,val}.jsonl: the distinct toy-hard problems of at most MAX_OPS operations
    among 20000 drawn with a fixed seed, shuffled once, `held_out` of them held out and the next
    TRAIN kept for training (kept when already there)
    -> (train path, val path)."""
    folder = os.path.join(out, "problems")
    paths = os.path.join(folder, "train.jsonl"), os.path.join(folder, "val.jsonl")
    if all(os.path.exists(p) for p in paths):
        return paths
    os.makedirs(folder, exist_ok=True)
    distinct = {}
    for p in toy_problems(20000, 777, "toy-hard"):
        if len(p["steps"]) <= MAX_OPS:
            distinct.setdefault(p["prompt"], {"prompt": p["prompt"], "answer": p["answer"]})
    problems = list(distinct.values())
    random.Random(0).shuffle(problems)
    for path, rows in zip(paths, (problems[held_out:held_out + TRAIN], problems[:held_out])):
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(path + ".tmp", path)
    return paths


def run_dir(out, name, seed):
    return os.path.join(out, f"{name}-s{seed}")


def run_minutes(path):
    """The machine-minutes train_all measured for a run (its wall-clock x the share of the cores it
    had, evals included), 0 when it did not."""
    try:
        with open(os.path.join(path, "study_minutes.json")) as f:
            return float(json.load(f))
    except (OSError, ValueError):
        return 0.0


def finished(path, steps):
    """A run is finished when its metrics hold the eval of its last step, or when train.py stopped
    it early (a "stopped" line: e.g. a collapse that left no prompt to train on; training it again
    with the same seed would only repeat it)."""
    try:
        records = read_jsonl(os.path.join(path, "metrics.jsonl"))
        return any(r.get("kind") == "stopped" or
                   (r.get("kind") == "eval" and r.get("step") == steps) for _, r in records)
    except (OSError, ValueError):
        return False


def run_command(name, flags, path, seed, steps, data, extra):
    """train.py's command line for one run: under torchrun (2 ranks) for the off-policy variants,
    else one process (the synchronous loop, `--mode sync` of one generator)."""
    here = os.path.dirname(os.path.abspath(__file__))
    launch = ([sys.executable, "-m", "torch.distributed.run", *LOOPBACK_TORCHRUN,
               "--rdzv-endpoint", rendezvous_file(path), "--nproc_per_node", "2"]
              if name in RANKS else [sys.executable])
    return [*launch, os.path.join(here, "train.py"), "--out", path, "--overwrite",
            "--seed", str(seed), "--steps", str(steps), "--model", toy_model_dir(preset="toy-hard"),
            "--data", data[0], "--val_data", data[1], *TASK, *PINS, *extra, *flags]


def rendezvous_file(path, remove=False):
    """The file a torchrun run's launcher rendezvous in, beside the run's folder; remove: delete it
    (before a run, as it holds the last one's keys, and after)."""
    file = path + ".rendezvous"
    if remove and os.path.exists(file):
        os.remove(file)
    return file


def pace(minutes, name):
    """The expected machine-minutes of one run of `name` from the finished runs' {kind: [minutes]}
    (kind: True under torchrun), None before any run finished. A torchrun run with none of its kind
    measured yet: 1.4 one-process runs (measured on 2 cores: 58 s against 41.5 s for 40 steps)."""
    # a finished run without its minutes (0: not timed by train_all) says nothing of the pace
    own, other = ([m for m in minutes[k] if m > 0] for k in (name in RANKS, name not in RANKS))
    if own:
        return float(np.mean(own))
    return float(np.mean(other)) * (1.4 if name in RANKS else 1 / 1.4) if other else None


def train_all(out, variants, seeds, steps, budget_min, extra=(), held_out=HELD_OUT):
    """Train every (variant, seed) not finished yet, variant by variant in priority order:
    one-process runs PARALLEL at a time (one torch thread each), a torchrun run alone. A variant
    starts only if its runs fit in the budget (the machine-minutes of the finished and started runs,
    plus the variant's runs at their kind's pace) -> the variants left out."""
    data = make_problems(out, held_out)
    minutes = {True: [], False: []}  # finished runs' machine-minutes, by kind (torchrun or not)
    for name in variants:
        for s in range(seeds):
            if finished(run_dir(out, name, s), steps):
                minutes[name in RANKS].append(run_minutes(run_dir(out, name, s)))
    t0, running, left_out = time.time(), [], []
    spent = lambda: sum(map(sum, minutes.values())) + sum(r["expected"] for r in running)

    def wait(free):  # until `free` cores are free: record each run that ends
        while True:
            for r in list(running):
                code = r["proc"].poll()
                if code is None:
                    continue
                running.remove(r)
                r["log"].close()
                rendezvous_file(r["path"], remove=True)
                if code:
                    for other in running:
                        other["proc"].kill()
                    sys.exit(f"study: {r['name']} seed {r['seed']} failed; "
                             f"its log: {r['log'].name}")
                used = (time.time() - r["start"]) / 60 * r["cores"] / PARALLEL
                minutes[r["name"] in RANKS].append(used)
                with open(os.path.join(r["path"], "study_minutes.json"), "w") as f:
                    json.dump(used, f)
            if PARALLEL - sum(r["cores"] for r in running) >= free:
                return
            time.sleep(0.2)

    for name, flags in variants.items():
        todo = [s for s in range(seeds) if not finished(run_dir(out, name, s), steps)]
        expected = pace(minutes, name)
        if todo and expected is not None and spent() + len(todo) * expected > budget_min:
            left_out.append(name)
            continue
        for seed in todo:
            cores = PARALLEL if name in RANKS else 1
            wait(cores)
            path = run_dir(out, name, seed)
            print(f"study: [{name} seed {seed}] -> {path} "
                  f"({(time.time() - t0) / 60:.1f} min so far, budget {budget_min:g} min)",
                  flush=True)
            log = open(os.path.join(out, f"{name}-s{seed}.log"), "w")
            cmd = run_command(name, flags, path, seed, steps, data, extra)
            rendezvous_file(path, remove=True)
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env=os.environ | {"OMP_NUM_THREADS": "1", **LOOPBACK_ENV})
            running.append(dict(name=name, seed=seed, path=path, proc=proc, log=log, cores=cores,
                                start=time.time(), expected=expected or 0.0))
    wait(PARALLEL)
    if left_out:
        print(f"study: over the budget of {budget_min:g} min, left out: {', '.join(left_out)} "
              f"(a larger --budget runs them; finished runs are kept)", flush=True)
    return left_out

# -----------------------------------------------------------------------------
# fitting and judging


def run_logs(path):
    """What a run's metrics say besides its curve, read once -> (the standard error of its last
    eval, pass_rate_se, NaN when it logged none; what its knobs did: the shares of samples
    interrupted and truncated, of prompts dropped as zero-variance, the mean length and lag (means
    over the steps), and at the end the prompts retired by No-Positive-Resampling and the epoch
    reached (a retired prompt is only ever skipped from epoch 1 on); NaN where the run did not log
    a field)."""
    records = [r for _, r in read_jsonl(os.path.join(path, "metrics.jsonl"))]
    evals = [r for r in records if r.get("kind") == "eval"]
    train = [r for r in records if r.get("kind") == "train"]
    nan = float("nan")
    se = float(evals[-1].get("pass_rate_se", nan)) if evals else nan
    values = lambda key: [r[key] for r in train if key in r]  # noqa: E731
    mean = lambda v: float(np.mean(v)) if v else nan  # noqa: E731
    zero_var = [r["dropped_zero_var"] / max(r.get("prompts", 1), 1) for r in train
                if "dropped_zero_var" in r]
    return se, dict(interrupted=mean(values("intr")), truncated=mean(values("trunc")),
                    zero_var=mean(zero_var), length=mean(values("len")), lag=mean(values("lag")),
                    retired=float((values("retired") or [nan])[-1]),
                    epoch=float((values("epoch") or [nan])[-1]))


def seed_average(runs):
    """The seeds' curves averaged at their common evals -> (C, R)."""
    n = min(len(r[0]) for r in runs)
    return np.mean([r[0][:n] for r in runs], 0), np.mean([r[1][:n] for r in runs], 0)


def analyze(out, names, seeds, compute):
    """Fit every run in one compute unit -> ({variant: dict(runs=[per-run dict], A, A_sd, B, B_sd,
    C_mid, se, ...)}, the shared A of the comparison rule)."""
    fits = {}
    for name in names:
        runs = []
        for s in range(seeds):
            path = run_dir(out, name, s)
            C, R, _ = load_run(path, compute)
            C, R = check_points(C, R)
            collapsed = bool(R[-1] < R.max() - COLLAPSE_DROP)
            fit = fit_sigmoid(C, R)
            late = C >= WOBBLE_FROM * C[-1]
            wobble = float(np.std(R[late] - sigmoid(C[late], fit["A"], fit["B"], fit["C_mid"],
                                                    fit["R0"])))
            extrap = None if collapsed else extrapolation_check(C, R)
            if extrap:  # the same prediction against the run's own full fit at its end (its
                # trend, without the last eval's wobble)
                trend = float(sigmoid(C[-1], fit["A"], fit["B"], fit["C_mid"], fit["R0"]))
                extrap |= dict(trend=trend, vs_trend=extrap["predicted"] - trend)
            se, training = run_logs(path)
            runs.append(dict(seed=s, C=C, R=R, fit=fit, se=se, wobble=wobble,
                             collapsed=collapsed, extrap=extrap, training=training))
        fits[name] = runs
    shared_A = float(np.mean([r["fit"]["A"] for runs in fits.values() for r in runs]))
    table = {}
    for name, runs in fits.items():
        for r in runs:
            r["refit"] = fit_sigmoid(r["C"], r["R"], R0=r["fit"]["R0"], A=shared_A)
        A = [r["fit"]["A"] for r in runs]
        B = [r["refit"]["B"] for r in runs]
        C_avg, R_avg = seed_average([(r["C"], r["R"]) for r in runs])
        logC = [np.log10(r["refit"]["C_mid"]) for r in runs]
        table[name] = dict(runs=runs, A=float(np.mean(A)), A_sd=float(np.std(A)),
                           B=float(np.mean(B)), B_sd=float(np.std(B)),
                           C_mid=float(10 ** np.mean(logC)), logC_sd=float(np.std(logC)),
                           se=(float(np.nanmean([r["se"] for r in runs]))
                               if any(np.isfinite(r["se"]) for r in runs) else float("nan")),
                           R0=float(np.mean([r["fit"]["R0"] for r in runs])),
                           R_last=float(R_avg[-1]), C_last=float(C_avg[-1]), curve=(C_avg, R_avg))
    return table, shared_A


def eval_margin(a, b):
    """2 x the standard error of the difference of two variants' seed means, from their last evals'
    standard errors (0 when a run logged none)."""
    se = [t["se"] ** 2 / len(t["runs"]) for t in (a, b) if np.isfinite(t["se"])]
    return 2 * float(np.sqrt(sum(se))) if len(se) == 2 else 0.0


def judge(x, y, rule, table):
    """One finding -> ('reproduced' | 'not reproduced' | 'inconclusive', the margin on the deciding
    quantity, the numbers behind it)."""
    a, b = table[x], table[y]
    noise = eval_margin(a, b)
    dA, margin_A = a["A"] - b["A"], max(NOISE_A, a["A_sd"] + b["A_sd"], noise)
    dB, margin_B = a["B"] - b["B"], a["B_sd"] + b["B_sd"]
    similar = abs(dA) <= margin_A
    why = (f"A {a['A']:.3f} vs {b['A']:.3f} (margin {margin_A:.3f}: "
           f"seeds {a['A_sd'] + b['A_sd']:.3f}, eval {noise:.3f}); "
           f"B {a['B']:.2f} vs {b['B']:.2f} (margin {margin_B:.2f})")
    if rule == "early":
        C_q, margin = 0.25 * min(a["C_last"], b["C_last"]), max(NOISE_A, noise)
        ra, rb = (float(np.interp(C_q, *t["curve"])) for t in (a, b))
        why = f"pass rate at C = {C_q:.3g}: {ra:.3f} vs {rb:.3f} (margin {margin:.3f})"
        return ("reproduced" if ra - rb > margin else
                "not reproduced" if rb - ra > margin else "inconclusive"), margin, why
    if rule == "efficiency":  # a similar A, reached with less compute: a higher B or a lower C_mid
        dC, margin_C = np.log10(a["C_mid"] / b["C_mid"]), max(a["logC_sd"] + b["logC_sd"], 0.02)
        better, worse = dB > margin_B or dC < -margin_C, dB < -margin_B or dC > margin_C
        why += (f"; log10 C_mid {np.log10(a['C_mid']):.2f} vs {np.log10(b['C_mid']):.2f} "
                f"(margin {margin_C:.2f})")
        verdict = ("reproduced" if similar and better and not worse else
                   "not reproduced" if not similar or (worse and not better) else "inconclusive")
        return verdict, margin_A if not similar else margin_B, why
    if rule == "A":
        verdict = ("reproduced" if dA > margin_A else
                   "not reproduced" if dA < -margin_A else "inconclusive")
    else:  # "A or B"
        verdict = ("reproduced" if dA > margin_A or (similar and dB > margin_B) else
                   "not reproduced" if dA < -margin_A or (similar and dB < -margin_B) else
                   "inconclusive")
    return verdict, (margin_B if rule == "A or B" and similar else margin_A), why


def extrapolation_count(table):
    """(runs whose half-compute prediction lands within 0.02 of their last eval, runs checked)."""
    errors = [r["extrap"]["error"] for t in table.values() for r in t["runs"] if r["extrap"]]
    return sum(abs(e) <= NOISE_A for e in errors), len(errors)


def judge_predictability(within, n):
    """The predictability finding from `within` of `n` checked runs landing within 0.02: reproduced
    for at least 80%, not reproduced for under half, else (and when no run could be checked)
    inconclusive."""
    if not n:
        return ("inconclusive",
                "no run could be checked: none has enough points in its first half to fit")
    verdict = ("reproduced" if within >= 0.8 * n else
               "not reproduced" if within * 2 < n else "inconclusive")
    return verdict, f"{within} of {n} runs within 0.02"

# -----------------------------------------------------------------------------
# the report


def variant_rows(table):
    rows = ["| variant | flags | seeds | A mean | A sd | eval se | B (shared A) | B sd | "
            "C_mid (shared A) | R0 | R last | collapsed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in table.items():
        flags = ((" ".join(VARIANTS.get(name, [])) or "(ScaleRL)") +
                 (" (torchrun)" if name in RANKS else ""))
        rows.append(f"| {name} | `{flags}` | {len(t['runs'])} | {t['A']:.3f} | {t['A_sd']:.3f} | "
                    f"{t['se']:.3f} | {t['B']:.2f} | {t['B_sd']:.2f} | {t['C_mid']:.3g} | "
                    f"{t['R0']:.3f} | {t['R_last']:.3f} | "
                    f"{sum(r['collapsed'] for r in t['runs'])} |")
    return rows


def training_rows(table):
    """What each variant's knobs did in training (seed means): whether the choice a finding is
    about acted at all (interruptions, truncations, prompts retired and revisited)."""
    rows = ["| variant | interrupted | truncated | zero-variance prompts dropped | length | lag | "
            "retired by NPR at the end | last epoch |", "|---|---|---|---|---|---|---|---|"]
    show = lambda v, spec: "-" if np.isnan(v) else format(v, spec)  # noqa: E731
    for name, t in table.items():
        m = {k: np.mean([r["training"][k] for r in t["runs"]]) for k in t["runs"][0]["training"]}
        rows.append(f"| {name} | {show(m['interrupted'], '.1%')} | {show(m['truncated'], '.1%')} | "
                    f"{show(m['zero_var'], '.0%')} | {show(m['length'], '.1f')} | "
                    f"{show(m['lag'], '.1f')} | {show(m['retired'], '.0f')} | "
                    f"{show(m['epoch'], '.1f')} |")
    return rows


def extrapolation_rows(table):
    rows = ["| run | fitted on C <= | points | predicted at the end | measured | error | "
            "full fit at the end | error vs full fit | C_half / C_mid | wobble |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in table.items():
        for r in t["runs"]:
            x = r["extrap"]
            rows.append(f"| {name}-s{r['seed']} | " +
                        (f"{x['C_half']:.3g} | {x['n']} | {x['predicted']:.3f} | "
                         f"{x['measured']:.3f} | {x['error']:+.3f} | {x['trend']:.3f} | "
                         f"{x['vs_trend']:+.3f} | {x['C_half'] / r['fit']['C_mid']:.1f} | "
                         f"{r['wobble']:.3f} |" if x else
                         ("collapsed" if r["collapsed"] else "too few points") + " |" * 10))
    return rows


def extrapolation_sources(table):
    """Where the half-compute misses come from, one sentence: the predictions against each run's
    own full fit (the trend), the last evals against that trend, the evals' wobble about it, and how
    far past its midpoint a run's first half reaches."""
    xs = [(r["extrap"], r["fit"]) for t in table.values() for r in t["runs"] if r["extrap"]]
    wobble = [r["wobble"] for t in table.values() for r in t["runs"] if r["extrap"]]
    if not xs:
        return ""
    vs_trend = np.array([x["vs_trend"] for x, _ in xs])
    pred = int((abs(vs_trend) <= NOISE_A).sum())
    last = sum(abs(x["measured"] - x["trend"]) <= NOISE_A for x, _ in xs)
    depth = np.array([x["C_half"] / f["C_mid"] for x, f in xs])
    # the share of the gain (A - R0) still to come at C_half, by the run's full fit
    left = np.percentile([1 / (1 + d ** f["B"]) for d, (_, f) in zip(depth, xs)], [25, 50, 75])
    return (f"Where the misses come from: against each run's own full fit at its end (its trend, "
            f"without the last eval's wobble), {pred} of {len(xs)} first-half predictions land "
            f"within 0.02 (their errors: mean {vs_trend.mean():+.3f}, sd {vs_trend.std():.3f}); "
            f"the last evals lie within 0.02 of that trend in {last} of {len(xs)}, and the evals "
            f"wobble about it by a median sd of {np.median(wobble):.3f} from {WOBBLE_FROM:.0%} of "
            f"the compute on (max {max(wobble):.3f}). The first half "
            f"ends at a median {np.median(depth):.1f} x the run's C_mid, with a median "
            f"{left[1]:.0%} of the gain still to come (quartiles {left[0]:.0%}, {left[2]:.0%}) "
            f"(the paper's Fig. 1 "
            f"fits its 8B run up to 50k GPU-hours, about 20x its C_mid of 2.5k, and its MoE run "
            f"up to 16k, about 4x its C_mid of 4.2k).")


def write_report(out, names, seeds, steps, minutes=None, left_out=(), quick=False):
    """Fit every run (FLOPs and device-seconds), judge the findings each in its unit, write
    report.md, study_report.json and the two figures -> the report's text."""
    tables = {unit: analyze(out, names, seeds, unit) for unit in ("flops", "compute_s")}
    found = []
    for finding, claim, x, y, rule, unit in FINDINGS:
        if x in names and y in names:
            verdict, margin, why = judge(x, y, rule, tables[unit][0])
            found.append(dict(name=f"{finding}: {x} vs {y}", paper=claim, verdict=verdict,
                              margin=margin, unit=UNIT_NAMES[unit], why=why))
    table = tables["flops"][0]
    within, n = extrapolation_count(table)
    verdict, why = judge_predictability(within, n)
    found.append(dict(name="predictability",
                      paper="a fit on the first half of the compute predicts the end within 0.02 "
                            "(Fig. 1)",
                      verdict=verdict, margin=NOISE_A, unit="FLOPs", why=why))
    # the same test on each variant's seed-averaged curve: the seeds' training noise averaged out
    averaged = {name: extrapolation_check(*t["curve"]) for name, t in table.items()}
    averaged = {name: x["error"] for name, x in averaged.items() if x}
    avg_within = sum(abs(e) <= NOISE_A for e in averaged.values())
    runs = [r | {"variant": name} for name, t in table.items() for r in t["runs"]]
    collapsed = [f"{r['variant']}-s{r['seed']}" for r in runs if r["collapsed"]]
    scalerl = table.get("scalerl")
    decided = sum(f["verdict"] != "inconclusive" for f in found)
    lines = ([QUICK_NOTE, ""] if quick else []) + [
        f"# The miniature ScaleRL study: {len(table)} variants x {seeds} seeds, "
        f"{len(runs)} runs of {steps} steps on toy-hard's chains of 2 to {MAX_OPS} operations", "",
        f"Written by `python study.py {out}`" +
        (f": {minutes:.0f} min of runs on this machine." if minutes else "."), "",
        f"{decided} of {len(found)} findings decided. " +
        (f"ScaleRL's A over its seeds: {scalerl['A']:.3f} +- {scalerl['A_sd']:.3f} (sd), "
         f"the eval's own standard error {scalerl['se']:.3f}. " if scalerl else "") +
        f"Half-compute extrapolation: {within} of {n} non-collapsed runs within 0.02 "
        f"({avg_within} of {len(averaged)} seed-averaged curves). "
        f"Collapsed runs: {', '.join(collapsed) or 'none'}." +
        (f" Left out over the budget: {', '.join(left_out)}." if left_out else ""), "",
        "## The paper's findings", "", "| finding | the paper | here | margin | numbers |",
        "|---|---|---|---|---|"]
    lines += [f"| {f['name']} ({f['unit']}) | {f['paper']} | **{f['verdict']}** | "
              f"{f['margin']:.3f} | {f['why']} |" for f in found]
    for unit, (t, shared_A) in tables.items():
        lines += ["",
                  f"## Per variant, compute in {UNIT_NAMES[unit]} (shared A = {shared_A:.3f})", ""]
        lines += variant_rows(t)
    lines += (["", "## What the knobs did in training (seed means; shares over the steps)", ""] +
              training_rows(table))
    lines += (["", f"## Extrapolation test (FLOPs): {within} of {n} runs within 0.02", ""] +
              extrapolation_rows(table))
    lines += ["", f"Seed-averaged curves, the same test: {avg_within} of {len(averaged)} within "
              "0.02 (" + ", ".join(f"{name} {e:+.3f}" for name, e in averaged.items()) + ").",
              "", extrapolation_sources(table)]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    summary = {"runs": [{"variant": r["variant"], "seed": r["seed"], "A": r["fit"]["A"],
                         "B": r["fit"]["B"], "C_mid": r["fit"]["C_mid"], "final": float(r["R"][-1]),
                         "extrap_error": r["extrap"]["error"] if r["extrap"] else None,
                         "extrap_error_vs_full_fit": (r["extrap"]["vs_trend"] if r["extrap"]
                                                      else None),
                         "collapsed": r["collapsed"], "eval_se": r["se"], "wobble": r["wobble"],
                         "training": r["training"], "compute": "FLOPs"}
                        for r in runs],
               "findings": [{k: f[k] for k in ("name", "paper", "verdict", "margin", "unit", "why")}
                            for f in found],
               "minutes": round(minutes, 1) if minutes else None, "steps": steps, "seeds": seeds,
               "left_out": list(left_out), "extrapolation_within": [within, n],
               "extrapolation_seed_averaged": averaged, "quick": quick}
    if quick:
        summary = {"note": QUICK_NOTE, **summary}
    with open(os.path.join(out, "study_report.json"), "w") as f:
        json.dump(summary, f, indent=1, default=lambda v: None if v != v else v)
    draw(out, table)
    return text


def draw(out, table):
    """study.png: the seed-averaged curves and their fits (FLOPs); study_extrap.png: each run fitted
    on the first half of its compute."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pooled = []
    for name, t in table.items():
        C, R = t["curve"]
        pooled.append(dict(run=name, C=C, R=R, used=(C > 0) & (C >= fit_start(C)), data=(C, R),
                           fit=fit_sigmoid(C, R), compute="flops",
                           metric=f"held-out pass rate ({HELD_OUT} prompts)"))
    plot(pooled, os.path.join(out, "study.png"), os.path.join(out, "study_linear.png"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (name, t) in enumerate(table.items()):
        col = color(plt, k, len(table))
        for r in t["runs"]:
            C, R, x = r["C"], r["R"], r["extrap"]
            ax.scatter(C[C > 0], R[C > 0], s=4, color=col, alpha=0.4)
            if x:
                half = fit_sigmoid(C[C <= x["C_half"]], R[C <= x["C_half"]])
                grid = np.geomspace(C[C > 0][0], C[-1], 100)
                ax.plot(grid, sigmoid(grid, half["A"], half["B"], half["C_mid"], half["R0"]), "--",
                        lw=0.8, color=col, label=name if r["seed"] == 0 else None)
    ax.set(xscale="log", xlabel="compute (FLOPs)", ylabel="held-out pass rate",
           title="each run fitted on the first half of its compute, extrapolated to its end")
    # no legend when no run had enough points in its first half
    save_figure(fig, ax, os.path.join(out, "study_extrap.png"), len(table))
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description="The miniature ScaleRL study on the toy-hard task.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", help="the study's folder (one sub-folder per run)")
    p.add_argument("--budget", type=float, default=90,
                   help="minutes of training: variants that would not fit are left out "
                        "(priority order: study.VARIANTS)")
    p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps per run")
    p.add_argument("--report", action="store_true",
                   help="only fit the runs in the folder and write the report")
    p.add_argument("--assets", default="",
                   help="also copy study_report.json, study.png, study_extrap.png here")
    p.add_argument("--quick", action="store_true",
                   help="3 variants x 1 seed x 10 tiny steps (the test's form)")
    args = p.parse_args(argv)
    variants, seeds, extra, steps, held_out = VARIANTS, SEEDS, [], args.steps, HELD_OUT
    if args.quick:  # two one-process runs side by side and one under torchrun
        variants = {n: VARIANTS[n] for n in ("scalerl", "batch8", "pipelinerl")}
        seeds, steps, held_out = 1, 10, 16
        extra = ["--prompts", "4", "--samples", "4", "--eval_every", "2", "--eval_samples", "1"]
    os.makedirs(args.out, exist_ok=True)
    if not args.report:
        train_all(args.out, variants, seeds, steps, args.budget, extra, held_out=held_out)
    names = [n for n in variants
             if all(finished(run_dir(args.out, n, s), steps) for s in range(seeds))]
    if not names:
        sys.exit(f"study: no variant has all {seeds} seeds finished in {args.out}")
    minutes = sum(run_minutes(run_dir(args.out, n, s)) for n in names for s in range(seeds))
    print(write_report(args.out, names, seeds, steps, minutes,
                       [n for n in variants if n not in names], args.quick))
    written = ["report.md", "study_report.json", "study.png", "study_extrap.png"]
    if args.assets:
        os.makedirs(args.assets, exist_ok=True)
        for name in written[1:]:
            shutil.copyfile(os.path.join(args.out, name), os.path.join(args.assets, name))
    print(f"wrote {', '.join(os.path.join(args.out, w) for w in written)}" +
          (f"; copied the last three to {args.assets}" if args.assets else ""))


if __name__ == "__main__":
    main()
