"""
The miniature ScaleRL study: ScaleRL and the paper's variants trained on the embedded toy-hard task,
5 seeds each, every run's sigmoid fitted (arXiv 2510.13786, Eq. 1), and a report of which of the
paper's findings the miniature reproduces, each by a paired test over the seeds (rules fixed before
any run). Design and results: docs/reference.md, "The miniature ScaleRL study". Start at VARIANTS,
FINDINGS and main.

    python study.py runs/study                   # within --budget; Ctrl-C, then again: resumes
    python study.py runs/study --assets assets   # also replace the committed report and figures
    python study.py runs/study --report          # only fit the runs there and write the report
    python study.py runs/study --quick           # 3 variants x 1 seed x a few steps (the test)

Writes report.md, study_report.json, study.png and study_extrap.png into the study's folder.
"""
import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
from scipy import stats

from data import read_jsonl
from runs import checkpoints, open_run_file, replace_file
from fit import (NOISE_A, check_points, checked_number, extrapolation_check, finite, fit_sigmoid,
                 fit_start, load_run, plot, sigmoid)
from plots import color, save_figure
from toy import toy_model_dir, toy_problems

SEEDS = (10, 11, 12, 13, 14)  # fresh: the exploratory study used 0-4
HELD_OUT = 2000       # the same for every run
TRAIN = 1500
MAX_OPS = 6           # toy-hard's chains of 2 to 6 operations
# collapsed: a last eval this far under the run's best
COLLAPSE_DROP = 0.05
# wobble: sd about the run's fit from here on
WOBBLE_FROM = 0.3
STEPS = 200
TASK = ["--think_budget", "64", "--lr", "2e-4", "--eval_every", "10", "--eval_samples", "1",
        "--save_every", "0"]
# train.py flags on ScaleRL's defaults, in priority order under --budget
VARIANTS = {
    "scalerl": [],  # one process
    "no_zero_var": ["--no-zero_var_filter"],
    "no_npr": ["--no-no_positive_resampling"],
    "batch32": ["--prompts", "32"],
    "agg_sample": ["--agg", "sample"],
    "norm_prompt": ["--adv_norm", "prompt"],
}
# under torchrun: in one process every ratio is 1, so the losses take the same step
RANKS = {"pipelinerl", "loss_dapo", "ppo_offpolicy", "sync"}
# torchrun on 127.0.0.1 only: a file rendezvous, no launcher store
LOOPBACK_TORCHRUN = ["--rdzv-backend", "c10d", "--rdzv-conf", "store_type=file",
                     "--local-addr", "127.0.0.1"]
LOOPBACK_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# one-process runs side by side, one thread each
PARALLEL = 2
PROGRESS_S = 60
# the statistics, fixed before the runs (statistics_lines)
ALPHA = 0.05
MIN_PAIRS = 5
MIN_EFFECT = 0.01
NI_MARGIN = 0.02
A_CAP = 1.0
A_CAP_TOL = 5e-4      # within this of A_CAP: at the cap
# (finding, claim, X (better), Y, rule, unit, endpoint)
FINDINGS = [
    ("off-policy algorithm", "PipelineRL-8 is more efficient than PPO-off-policy-8 at a similar A "
     "(Fig. 4a)", "pipelinerl", "ppo_offpolicy", "superiority", "compute_s", "auc_device_s"),
    ("off-policy algorithm", "PipelineRL-8 vs the synchronous loop: the same reading",
     "pipelinerl", "sync", "superiority", "compute_s", "auc_device_s"),
    ("loss type", "CISPO reaches a higher A than DAPO (Fig. 5a)",
     "pipelinerl", "loss_dapo", "superiority", "flops", "final_mean3"),
    ("zero-variance filtering", "ScaleRL with it is at least as good as without",
     "scalerl", "no_zero_var", "non-inferiority", "flops", "final_mean3"),
    ("No-Positive-Resampling", "ScaleRL with it is at least as good as without",
     "scalerl", "no_npr", "non-inferiority", "flops", "final_mean3"),
    ("length control", "interruptions are at least as good as a length penalty",
     "scalerl", "length_penalty", "non-inferiority", "flops", "final_mean3"),
    ("batch size", "a smaller batch (8 vs 16 prompts) looks better early (section 5)",
     "batch8", "scalerl", "superiority", "flops", "auc_flops"),
    ("batch size", "a larger batch (32 vs 16 prompts) lifts A (section 5)",
     "batch32", "scalerl", "superiority", "flops", "final_mean3"),
]
UNIT_NAMES = {"compute_s": "device-seconds", "flops": "FLOPs"}
AUC_UNITS = {"auc_flops": "flops", "auc_device_s": "compute_s"}
QUICK_NOTE = ("QUICK STUDY: a few tiny steps per run, to test the machinery; these numbers mean "
              "nothing.")

# -----------------------------------------------------------------------------
# the problems and the runs


def make_problems(out, held_out=HELD_OUT, max_ops=MAX_OPS):
    """The study's problem files (train, held-out), made once -> their paths."""
    folder = os.path.join(out, "problems")
    paths = os.path.join(folder, "train.jsonl"), os.path.join(folder, "val.jsonl")
    if all(os.path.exists(p) for p in paths):
        return paths
    os.makedirs(folder, exist_ok=True)
    distinct = {}
    for p in toy_problems(20000, 777, "toy-hard"):
        if len(p["steps"]) <= max_ops:
            distinct.setdefault(p["prompt"], {"prompt": p["prompt"], "answer": p["answer"]})
    problems = list(distinct.values())
    random.Random(0).shuffle(problems)
    for path, rows in zip(paths, (problems[held_out:held_out + TRAIN], problems[:held_out])):
        replace_file(path, lambda f: f.writelines(json.dumps(r) + "\n" for r in rows))
    return paths


def run_dir(out, name, seed):
    return os.path.join(out, f"{name}-s{seed}")


def run_minutes(path):
    """A run's machine-minutes as train_all measured them, else 0."""
    try:
        with open(os.path.join(path, "study_minutes.json")) as f:
            minutes = json.load(f)
    except (OSError, ValueError):
        return 0.0
    return float(minutes) if finite(minutes) and minutes >= 0 else 0.0


def finished(path, steps):
    """Whether a run holds its last step's eval, or train.py stopped it."""
    try:
        records = read_jsonl(os.path.join(path, "metrics.jsonl"))
        return any(r.get("kind") == "stopped" or
                   (r.get("kind") == "eval" and r.get("step") == steps) for _, r in records)
    except (OSError, ValueError):
        return False


def run_command(name, flags, path, seed, steps, data, extra):
    """train.py's command line for one run (torchrun for RANKS; --resume from a checkpoint)."""
    here = os.path.dirname(os.path.abspath(__file__))
    launch = ([sys.executable, "-m", "torch.distributed.run", *LOOPBACK_TORCHRUN,
               "--rdzv-endpoint", rendezvous_file(path), "--nproc_per_node", "2"]
              if name in RANKS else [sys.executable])
    return [*launch, os.path.join(here, "train.py"), "--out", path,
            "--resume" if checkpoints(path) else "--overwrite",
            "--seed", str(seed), *task_flags(data, steps), *extra, *flags]


def task_flags(data, steps):
    """train.py's flags for the study's task."""
    return ["--steps", str(steps), "--model", toy_model_dir(preset="toy-hard"), "--data", data[0],
            "--val_data", data[1], *TASK]


def rendezvous_file(path, remove=False):
    """A torchrun run's rendezvous file beside its folder; remove: delete it."""
    file = path + ".rendezvous"
    if remove and os.path.exists(file):
        os.remove(file)
    return file


def pace(minutes, name):
    """Expected machine-minutes of a run of `name`, from the finished runs, or None."""
    # not timed: says nothing of the pace
    own, other = ([m for m in minutes[k] if m > 0] for k in (name in RANKS, name not in RANKS))
    if own:
        return float(np.mean(own))
    return float(np.mean(other)) * (1.4 if name in RANKS else 1 / 1.4) if other else None


def last_step(path):
    try:
        return max((r.get("step", 0) for _, r in read_jsonl(os.path.join(path, "metrics.jsonl"))),
                   default=0)
    except (OSError, ValueError):
        return 0


def stop_runs(running, timeout=120):
    """SIGINT to every running run, then wait for them."""
    for r in running:
        with contextlib.suppress(OSError, AttributeError):
            r["proc"].send_signal(signal.SIGINT)
    if running:
        print(f"study: waiting up to {timeout} s for {len(running)} runs to save their last step "
              "(Ctrl-C again: stop at once)", flush=True)
    deadline = time.time() + timeout
    try:
        while any(r["proc"].poll() is None for r in running) and time.time() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    for r in running:
        if r["proc"].poll() is None:
            r["proc"].kill()


def save_minutes(r, spent):
    """A run's machine-minutes so far, beside it (a continued run adds its own)."""
    replace_file(os.path.join(r["path"], "study_minutes.json"), lambda f: json.dump(spent, f))


def start_run(out, name, flags, seed, steps, data, extra, cores, expected):
    """Start train.py for (name, seed), continued from its checkpoints where it has some."""
    path = run_dir(out, name, seed)
    cmd = run_command(name, flags, path, seed, steps, data, extra)
    resume = "--resume" in cmd
    log = open_run_file(os.path.join(out, f"{name}-s{seed}.log"), "a" if resume else "w")
    rendezvous_file(path, remove=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=os.environ | {"OMP_NUM_THREADS": "1", **LOOPBACK_ENV})
    return dict(name=name, seed=seed, path=path, proc=proc, log=log, cores=cores,
                start=time.time(), expected=expected or 0.0,
                before=run_minutes(path) if resume else 0.0, resume=resume)


def stop_study(running, used, steps, again, why, code):
    """Stop the runs (each saves its step), say where each stopped and how to continue, exit."""
    stopped = list(running)
    stop_runs(running)
    for r in stopped:
        save_minutes(r, used(r))
        print(f"study: {r['name']} seed {r['seed']} interrupted at step "
              f"{last_step(r['path'])}/{steps}; saved: "
              f"{(checkpoints(r['path'])[-1:] or ['nothing yet'])[0]}", flush=True)
    print(f"study: {why}; continue with: {again or 'the same command'} (finished runs are "
          "kept, interrupted ones continue from their last checkpoint)", flush=True)
    sys.exit(code)


def train_all(out, variants, seeds, steps, budget_min, extra=(), held_out=HELD_OUT, again=None):
    """Train every unfinished (variant, seed) in priority order within the budget -> the variants
    left out."""
    data = make_problems(out, held_out)
    minutes = {True: [], False: []}
    pending = []
    for n in variants:
        for s in seeds:
            if finished(run_dir(out, n, s), steps):
                minutes[n in RANKS].append(run_minutes(run_dir(out, n, s)))
            else:
                pending.append((n, s))
    t0, running, left_out, shown = time.time(), [], [], [time.time()]
    spent = lambda: sum(map(sum, minutes.values())) + sum(r["expected"] for r in running)
    used = lambda r: (time.time() - r["start"]) / 60 * r["cores"] / PARALLEL + r["before"]

    def eta():
        paces = [pace(minutes, n) for n, _ in pending]
        if None in paces:
            return "an ETA once a run has ended"
        left = sum(paces) + sum(max(0.0, r["expected"] - used(r)) for r in running)
        room = budget_min - sum(map(sum, minutes.values())) - sum(map(used, running))
        return f"about {max(0.0, min(left, room)):.0f} min left"

    def progress():
        done = sum(map(len, minutes.values()))
        runs = ", ".join(f"{r['name']} seed {r['seed']} step {last_step(r['path'])}/{steps}"
                         for r in running)
        print(f"study: {(time.time() - t0) / 60:.1f} min | {done} runs done, {len(pending)} to "
              f"start | running: {runs or 'none'} | {eta()}", flush=True)

    stop = lambda why, code: stop_study(running, used, steps, again, why, code)

    def wait(free):
        while True:
            for r in list(running):
                if (code := r["proc"].poll()) is None:
                    continue
                running.remove(r)
                r["log"].close()
                rendezvous_file(r["path"], remove=True)
                if code in (130, 143, -2, -15):
                    stop(f"{r['name']} seed {r['seed']} was stopped by a signal", 130)
                if code:
                    stop(f"{r['name']} seed {r['seed']} failed (exit {code}; its log: "
                         f"{r['log'].name})", 1)
                spent_r = used(r)
                minutes[r["name"] in RANKS].append(spent_r)
                save_minutes(r, spent_r)
                print(f"study: {r['name']} seed {r['seed']} done in {spent_r:.1f} machine-min | "
                      f"{eta()}", flush=True)
            if PARALLEL - sum(r["cores"] for r in running) >= free:
                return
            if time.time() - shown[0] >= PROGRESS_S:
                shown[0] = time.time()
                progress()
            time.sleep(0.2)

    try:
        for name, flags in variants.items():
            todo = [s for n, s in pending if n == name]
            expected = pace(minutes, name)
            if todo and expected is not None and spent() + len(todo) * expected > budget_min:
                left_out.append(name)
                pending[:] = [(n, s) for n, s in pending if n != name]
                continue
            for seed in todo:
                cores = PARALLEL if name in RANKS else 1
                wait(cores)
                pending.remove((name, seed))
                running.append(r := start_run(out, name, flags, seed, steps, data, extra, cores,
                                              expected))
                print(f"study: [{name} seed {seed}] -> {r['path']}"
                      f"{' (continued from its last checkpoint)' if r['resume'] else ''} | "
                      f"{(time.time() - t0) / 60:.1f} min so far, budget {budget_min:g} min, "
                      f"{eta()}", flush=True)
        wait(PARALLEL)
    except KeyboardInterrupt:
        stop("interrupted", 130)
    if left_out:
        print(f"study: over the budget of {budget_min:g} min, left out: {', '.join(left_out)} "
              f"(a larger --budget runs them; finished runs are kept)", flush=True)
    return left_out

# -----------------------------------------------------------------------------
# fitting and judging


NUMBERS = ("pass_rate_se", "intr", "trunc", "len", "lag", "retired", "epoch", "dropped_zero_var",
           "prompts")


def run_logs(path):
    """A run's last eval's standard error and what its knobs did (means; NaN where not logged)."""
    file = os.path.join(path, "metrics.jsonl")
    # checked: finite, or ValueError file:line
    records = [{k: checked_number(r, k, f"{file}:{i}")
                if k in NUMBERS and r.get("kind") in ("train", "eval") else v
                for k, v in r.items()} for i, r in read_jsonl(file)]
    evals = [r for r in records if r.get("kind") == "eval"]
    train = [r for r in records if r.get("kind") == "train"]
    nan = float("nan")
    se = evals[-1].get("pass_rate_se", nan) if evals else nan
    values = lambda key: [r[key] for r in train if key in r]  # noqa: E731
    mean = lambda v: float(np.mean(v)) if v else nan  # noqa: E731
    zero_var = [r["dropped_zero_var"] / max(r.get("prompts", 1), 1) for r in train
                if "dropped_zero_var" in r]
    return se, dict(interrupted=mean(values("intr")), truncated=mean(values("trunc")),
                    zero_var=mean(zero_var), length=mean(values("len")), lag=mean(values("lag")),
                    retired=float((values("retired") or [nan])[-1]),
                    epoch=float((values("epoch") or [nan])[-1]))


def seed_average(runs):
    n = min(len(r[0]) for r in runs)
    return np.mean([r[0][:n] for r in runs], 0), np.mean([r[1][:n] for r in runs], 0)


def sd(values):
    """Sample standard deviation (ddof 1); NaN under 2 values."""
    return float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")


def at_cap(A):
    return bool(A >= A_CAP - A_CAP_TOL)


def analyze(out, names, seeds, compute):
    """Fit every run in one compute unit -> ({variant: rows}, the shared A)."""
    fits = {}
    for name in names:
        runs = []
        for s in seeds:
            path = run_dir(out, name, s)
            C, R, _ = load_run(path, compute)
            C, R = check_points(C, R)
            collapsed = bool(R[-1] < R.max() - COLLAPSE_DROP)
            fit = fit_sigmoid(C, R)
            late = C >= WOBBLE_FROM * C[-1]
            wobble = sd(R[late] - sigmoid(C[late], fit["A"], fit["B"], fit["C_mid"], fit["R0"]))
            extrap = None if collapsed else extrapolation_check(C, R)
            if extrap:  # against the run's own full fit, and persistence
                trend = float(sigmoid(C[-1], fit["A"], fit["B"], fit["C_mid"], fit["R0"]))
                extrap |= dict(trend=trend, vs_trend=extrap["predicted"] - trend,
                               persistence=float(R[C <= extrap["C_half"]][-1]))
            se, training = run_logs(path)
            runs.append(dict(seed=s, C=C, R=R, fit=fit, se=se, wobble=wobble,
                             collapsed=collapsed, extrap=extrap, training=training,
                             final_mean3=float(np.mean(R[-3:]))))
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
        finals = [r["final_mean3"] for r in runs]
        table[name] = dict(runs=runs, A=float(np.mean(A)), A_sd=sd(A),
                           B=float(np.mean(B)), B_sd=sd(B),
                           C_mid=float(10 ** np.mean(logC)), logC_sd=sd(logC),
                           final_mean3=float(np.mean(finals)), final_mean3_sd=sd(finals),
                           se=(float(np.nanmean([r["se"] for r in runs]))
                               if any(np.isfinite(r["se"]) for r in runs) else float("nan")),
                           R0=float(np.mean([r["fit"]["R0"] for r in runs])),
                           curve=(C_avg, R_avg))
    return table, shared_A


def auc(C, R, upto):
    """Mean pass rate over [0, upto] (trapezoids), or None when the run ends before."""
    if C[-1] < upto:
        return None
    inside = C < upto
    Cs, Rs = np.append(C[inside], upto), np.append(R[inside], np.interp(upto, C, R))
    return float(np.sum(np.diff(Cs) * (Rs[1:] + Rs[:-1]) / 2) / upto)


def add_endpoints(tables, names):
    """Each run's AUC endpoints, to each unit's reference compute -> {unit: reference}."""
    auc_to = {}
    for key, unit in AUC_UNITS.items():
        table = tables[unit][0]
        compared = {v for f in FINDINGS if f[6] == key and f[2] in names and f[3] in names
                    for v in f[2:4]}
        upto = min(r["C"][-1] for name in (compared or table) for r in table[name]["runs"])
        for name, t in table.items():
            for r, target in zip(t["runs"], tables["flops"][0][name]["runs"]):
                target[key] = auc(r["C"], r["R"], upto)
        auc_to[UNIT_NAMES[unit]] = float(upto)
    return auc_to


def one_sided_p(x, y, shift, alternative):
    """p of a one-sided paired t-test of x + shift - y > 0; NaN under 2 pairs."""
    x, y = np.asarray(x, dtype=float) + shift, np.asarray(y, dtype=float)
    if len(x) < 2:
        return float("nan")
    d = x - y
    if np.ptp(d) == 0:
        return 0.0 if (d[0] > 0 if alternative == "greater" else d[0] < 0) else 1.0
    return float(stats.ttest_rel(x, y, alternative=alternative).pvalue)


def paired_test(x, y, rule):
    """One finding's paired test -> (verdict, p, p the other way, the test in words)."""
    if rule == "superiority":
        low, high = MIN_EFFECT, -MIN_EFFECT
    else:  # non-inferiority
        low = high = -NI_MARGIN
    p = one_sided_p(x, y, -low, "greater")
    p_other = one_sided_p(x, y, -high, "less")
    test = (f"one-sided paired t (scipy.stats.ttest_rel): X - Y > {low:+.2f} reproduces, "
            f"X - Y < {high:+.2f} refutes")
    if len(x) < MIN_PAIRS:
        return "inconclusive", p, p_other, test
    verdict = ("reproduced" if p <= ALPHA else
               "not reproduced" if p_other <= ALPHA else "inconclusive")
    return verdict, p, p_other, test


def judge_finding(finding, table):
    """One of FINDINGS -> its report dict."""
    name, claim, X, Y, rule, unit, key = finding
    by_seed = [{r["seed"]: r[key] for r in table[v]["runs"] if r.get(key) is not None}
               for v in (X, Y)]
    seeds = sorted(set(by_seed[0]) & set(by_seed[1]))
    x, y = ([b[s] for s in seeds] for b in by_seed)
    verdict, p, p_other, test = paired_test(x, y, rule)
    d = np.subtract(x, y)
    show = lambda v: "-" if v != v else f"{v:.3g}"  # noqa: E731
    why = (f"{key}: X {np.mean(x):.3f} vs Y {np.mean(y):.3f}, paired X - Y {np.mean(d):+.3f} "
           f"(sd {sd(d):.3f}) over {len(seeds)} pairs; p {show(p)} in the paper's direction, "
           f"{show(p_other)} the other way" if seeds else f"{key}: no pairs")
    return dict(name=f"{name}: {X} vs {Y}", paper=claim, verdict=verdict,
                margin=MIN_EFFECT if rule == "superiority" else NI_MARGIN, unit=UNIT_NAMES[unit],
                endpoint=key, rule=rule, test=test, pairs=len(seeds), p=p, p_other=p_other,
                seeds=seeds, x=x, y=y, why=why)


def predictability(table):
    """Half-compute predictions of the last evals against the persistence and constant baselines."""
    checked = [r["extrap"] for t in table.values() for r in t["runs"] if r["extrap"]]
    n = len(checked)
    out = dict(n=n, r=None, beats_both=False)
    measured = np.array([x["measured"] for x in checked])
    guesses = {"": [x["predicted"] for x in checked],
               "_persistence": [x["persistence"] for x in checked],
               "_constant": (measured.sum() - measured) / (n - 1) if n > 1 else [np.nan] * n}
    for tag, guess in guesses.items():
        err = np.asarray(guess, dtype=float) - measured
        out[f"within_0.02{tag}"] = [int((abs(err) <= NOISE_A).sum()), n]
        out[f"rmse{tag}"] = float(np.sqrt(np.mean(err ** 2))) if n and np.isfinite(err).all() \
            else None
    pred = np.array(guesses[""])
    if n > 2 and np.ptp(pred) > 0 and np.ptp(measured) > 0:
        out["r"] = float(np.corrcoef(pred, measured)[0, 1])
    base = [out["rmse_persistence"], out["rmse_constant"]]
    out["beats_both"] = bool(n and None not in base and out["rmse"] < min(base))
    return out


def judge_predictability(pred):
    """The predictability verdict and why."""
    within, n = pred["within_0.02"]
    if not n:
        return ("inconclusive",
                "no run could be checked: none has enough points in its first half to fit")
    show = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    why = (f"{within} of {n} runs within 0.02 (persistence {pred['within_0.02_persistence'][0]}, "
           f"constant {pred['within_0.02_constant'][0]}); RMSE {show(pred['rmse'])} against "
           f"persistence {show(pred['rmse_persistence'])} and constant "
           f"{show(pred['rmse_constant'])}; r = {show(pred['r'])}. ")
    losers = [name for name in ("persistence", "constant")
              if pred[f"rmse_{name}"] is None or pred["rmse"] >= pred[f"rmse_{name}"]]
    why += ("The sigmoid beats both baselines." if not losers else
            f"The sigmoid does NOT beat the {' and the '.join(losers)} baseline"
            f"{'s' if len(losers) > 1 else ''}: its within-0.02 count is not skill.")
    verdict = ("reproduced" if within >= 0.8 * n and not losers else
               "not reproduced" if within * 2 < n else "inconclusive")
    return verdict, why

# -----------------------------------------------------------------------------
# the report


def variant_rows(table):
    rows = ["| variant | flags | seeds | A mean | A sd | A at cap | eval se | B (shared A) | "
            "B sd | C_mid (shared A) | R0 | final_mean3 | final_mean3 sd | collapsed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in table.items():
        flags = ((" ".join(VARIANTS.get(name, [])) or "(ScaleRL)") +
                 (" (torchrun)" if name in RANKS else ""))
        capped = sum(at_cap(r["fit"]["A"]) for r in t["runs"])
        rows.append(f"| {name} | `{flags}` | {len(t['runs'])} | {t['A']:.3f} | {t['A_sd']:.3f} | "
                    f"{capped} | {t['se']:.3f} | {t['B']:.2f} | {t['B_sd']:.2f} | "
                    f"{t['C_mid']:.3g} | {t['R0']:.3f} | {t['final_mean3']:.3f} | "
                    f"{t['final_mean3_sd']:.3f} | {sum(r['collapsed'] for r in t['runs'])} |")
    return rows


def training_rows(table):
    """What each variant's knobs did in training (seed means)."""
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
    rows = ["| run | fitted on C <= | points | predicted at the end | persistence | measured | "
            "error | persistence error | full fit at the end | error vs full fit | "
            "C_half / C_mid | wobble |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in table.items():
        for r in t["runs"]:
            x = r["extrap"]
            rows.append(f"| {name}-s{r['seed']} | " +
                        (f"{x['C_half']:.3g} | {x['n']} | {x['predicted']:.3f} | "
                         f"{x['persistence']:.3f} | {x['measured']:.3f} | {x['error']:+.3f} | "
                         f"{x['persistence'] - x['measured']:+.3f} | {x['trend']:.3f} | "
                         f"{x['vs_trend']:+.3f} | {x['C_half'] / r['fit']['C_mid']:.1f} | "
                         f"{r['wobble']:.3f} |" if x else
                         ("collapsed" if r["collapsed"] else "too few points") + " |" * 11))
    return rows


def extrapolation_sources(table):
    """Where the half-compute misses come from, in one sentence."""
    xs = [(r["extrap"], r["fit"]) for t in table.values() for r in t["runs"] if r["extrap"]]
    wobble = [r["wobble"] for t in table.values() for r in t["runs"] if r["extrap"]]
    if not xs:
        return ""
    vs_trend = np.array([x["vs_trend"] for x, _ in xs])
    pred = int((abs(vs_trend) <= NOISE_A).sum())
    last = sum(abs(x["measured"] - x["trend"]) <= NOISE_A for x, _ in xs)
    depth = np.array([x["C_half"] / f["C_mid"] for x, f in xs])
    # gain still to come at C_half
    left = np.percentile([1 / (1 + d ** f["B"]) for d, (_, f) in zip(depth, xs)], [25, 50, 75])
    return (f"Where the misses come from: against each run's own full fit at its end (its trend, "
            f"without the last eval's wobble), {pred} of {len(xs)} first-half predictions land "
            f"within 0.02 (their errors: mean {vs_trend.mean():+.3f}, sd {sd(vs_trend):.3f}); "
            f"the last evals lie within 0.02 of that trend in {last} of {len(xs)}, and the evals "
            f"wobble about it by a median sd of {np.median(wobble):.3f} from {WOBBLE_FROM:.0%} of "
            f"the compute on (max {max(wobble):.3f}). The first half "
            f"ends at a median {np.median(depth):.1f} x the run's C_mid, with a median "
            f"{left[1]:.0%} of the gain still to come (quartiles {left[0]:.0%}, {left[2]:.0%}) "
            f"(the paper's Fig. 1 "
            f"fits its 8B run up to 50k GPU-hours, about 20x its C_mid of 2.5k, and its MoE run "
            f"up to 16k, about 4x its C_mid of 4.2k).")


def statistics_lines():
    """The report's statement of the rules."""
    return [
        "## Statistics, set before the runs", "",
        f"- Each finding compares X with Y seed by seed on one per-run endpoint (a pass rate): a "
        f"one-sided paired t-test (scipy.stats.ttest_rel, n - 1 degrees of freedom; every sd in "
        f"this report has ddof 1) at p <= {ALPHA}.",
        f"- Superiority (X better): reproduced when X - Y > {MIN_EFFECT} with p <= {ALPHA}; not "
        f"reproduced when X - Y < -{MIN_EFFECT} with p <= {ALPHA}. {MIN_EFFECT} is the floor on "
        f"every margin (about one eval's standard error).",
        f"- Non-inferiority (\"at least as good\"): reproduced when X - Y > -{NI_MARGIN} with "
        f"p <= {ALPHA}; not reproduced when X - Y < -{NI_MARGIN} with p <= {ALPHA}.",
        f"- Otherwise, and always with fewer than {MIN_PAIRS} pairs: inconclusive. Collapsed runs "
        f"stay in their pairs.",
        "- Endpoints: final_mean3 = the mean of a run's last 3 evals; auc_flops, auc_device_s = "
        "the trapezoid of its pass rate over compute from 0 to the unit's reference (auc_to), "
        "divided by it. Fitted A, B, C_mid are shown, not tested; fit_sigmoid caps A at "
        f"{A_CAP} (an A within {A_CAP_TOL} of it counts as at the cap)."]


def findings_lines(found):
    show = lambda v: "-" if v is None or v != v else f"{v:.3g}"  # noqa: E731
    lines = ["| finding | the paper | endpoint | test | pairs | p (paper's direction) | "
             "p (other way) | here | margin | numbers |", "|---" * 10 + "|"]
    return lines + [f"| {f['name']} ({f['unit']}) | {f['paper']} | {f['endpoint']} | {f['test']} | "
                    f"{f['pairs']} | {show(f['p'])} | {show(f['p_other'])} | **{f['verdict']}** | "
                    f"{f['margin']:.3f} | {f['why']} |" for f in found]


def report_lines(out, tables, found, pred, averaged, meta):
    """report.md's lines."""
    table = tables["flops"][0]
    runs = [r | {"variant": name} for name, t in table.items() for r in t["runs"]]
    collapsed = [f"{r['variant']}-s{r['seed']}" for r in runs if r["collapsed"]]
    capped = [f"{r['variant']}-s{r['seed']}" for r in runs if at_cap(r["fit"]["A"])]
    scalerl, within = table.get("scalerl"), pred["within_0.02"]
    avg_within = sum(abs(e) <= NOISE_A for e in averaged.values())
    decided = sum(f["verdict"] != "inconclusive" for f in found)
    minutes, left_out = meta["minutes"], meta["left_out"]
    lines = ([QUICK_NOTE, ""] if meta["quick"] else []) + [
        f"# The miniature ScaleRL study: {len(table)} variants x {len(meta['seeds'])} seeds, "
        f"{len(runs)} runs of {meta['steps']} steps on toy-hard's chains of 2 to {MAX_OPS} "
        "operations", "",
        f"Written by `python study.py {out}`" +
        (f": {minutes:.0f} min of runs on this machine." if minutes else "."), "",
        f"{decided} of {len(found)} findings decided. " +
        (f"ScaleRL's final_mean3 over its seeds: {scalerl['final_mean3']:.3f} +- "
         f"{scalerl['final_mean3_sd']:.3f} (sd); its fitted A {scalerl['A']:.3f} +- "
         f"{scalerl['A_sd']:.3f}, the eval's own standard error {scalerl['se']:.3f}. "
         if scalerl else "") +
        f"Runs with A at the fit's cap of {A_CAP}: {', '.join(capped) or 'none'}. "
        f"Half-compute extrapolation: {within[0]} of {within[1]} non-collapsed runs within 0.02 "
        f"({avg_within} of {len(averaged)} seed-averaged curves). "
        f"Collapsed runs: {', '.join(collapsed) or 'none'}." +
        (f" Left out over the budget: {', '.join(left_out)}." if left_out else ""), "",
        "## The paper's findings", ""] + findings_lines(found) + [""] + statistics_lines()
    auc_to = ", ".join(f"{unit} {c:.3g}" for unit, c in meta["auc_to"].items())
    for unit, (t, shared_A) in tables.items():
        lines += ["",
                  f"## Per variant, compute in {UNIT_NAMES[unit]} (shared A = {shared_A:.3f})", ""]
        lines += variant_rows(t)
    lines += ["", f"AUC endpoints up to: {auc_to}."]
    lines += (["", "## What the knobs did in training (seed means; shares over the steps)", ""] +
              training_rows(table))
    lines += (["", f"## Extrapolation test (FLOPs): {within[0]} of {within[1]} runs within 0.02",
               "", next(f["why"] for f in found if f["name"] == "predictability"), ""] +
              extrapolation_rows(table))
    lines += ["", f"Seed-averaged curves, the same test: {avg_within} of {len(averaged)} within "
              "0.02 (" + ", ".join(f"{name} {e:+.3f}" for name, e in averaged.items()) + ").",
              "", extrapolation_sources(table)]
    return lines


def clean(v):
    """v made JSON-safe: NaN -> null, numpy numbers -> plain."""
    if isinstance(v, dict):
        return {k: clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean(x) for x in v]
    if isinstance(v, (float, np.floating)):
        return None if v != v else float(v)
    return int(v) if isinstance(v, np.integer) else v


def summary_json(table, found, pred, averaged, meta):
    runs = [r | {"variant": name} for name, t in table.items() for r in t["runs"]]
    x = lambda r, k: r["extrap"][k] if r["extrap"] else None  # noqa: E731
    keys = ("name", "paper", "verdict", "margin", "unit", "why", "endpoint", "rule", "test",
            "pairs", "p", "p_other", "seeds", "x", "y")
    summary = {
        "runs": [{"variant": r["variant"], "seed": r["seed"], "A": r["fit"]["A"],
                  "A_at_cap": at_cap(r["fit"]["A"]), "B": r["fit"]["B"],
                  "C_mid": r["fit"]["C_mid"], "final": float(r["R"][-1]),
                  "final_mean3": r["final_mean3"], "auc_flops": r["auc_flops"],
                  "auc_device_s": r["auc_device_s"], "extrap_error": x(r, "error"),
                  "extrap_error_vs_full_fit": x(r, "vs_trend"),
                  "persistence_prediction": x(r, "persistence"), "collapsed": r["collapsed"],
                  "eval_se": r["se"], "wobble": r["wobble"], "training": r["training"],
                  "compute": "FLOPs"} for r in runs],
        "findings": [{k: f.get(k) for k in keys} for f in found],
        "predictability": pred,
        "minutes": round(meta["minutes"], 1) if meta["minutes"] else None,
        "steps": meta["steps"], "seeds": meta["seeds"], "left_out": list(meta["left_out"]),
        "extrapolation_within": pred["within_0.02"], "extrapolation_seed_averaged": averaged,
        "auc_to": meta["auc_to"], "A_cap": A_CAP,
        "statistics": {"test": "one-sided paired t, scipy.stats.ttest_rel", "alpha": ALPHA,
                       "min_pairs": MIN_PAIRS, "min_effect": MIN_EFFECT, "ni_margin": NI_MARGIN,
                       "ddof": 1},
        "quick": meta["quick"]}
    return clean({"note": QUICK_NOTE, **summary} if meta["quick"] else summary)


def write_report(out, names, seeds, steps, minutes=None, left_out=(), quick=False):
    """Fit, judge and write report.md, study_report.json and the figures -> the report."""
    tables = {unit: analyze(out, names, seeds, unit) for unit in ("flops", "compute_s")}
    table = tables["flops"][0]
    auc_to = add_endpoints(tables, names)
    found = [judge_finding(f, table) for f in FINDINGS if f[2] in names and f[3] in names]
    pred = predictability(table)
    verdict, why = judge_predictability(pred)
    found.append(dict(name="predictability",
                      paper="a fit on the first half of the compute predicts the end within 0.02 "
                            "(Fig. 1)",
                      verdict=verdict, margin=NOISE_A, unit="FLOPs", endpoint="extrap_error",
                      rule="skill", test="at least 80% within 0.02 and an RMSE below the "
                      "persistence and constant baselines'", pairs=pred["n"], p=None,
                      p_other=None, why=why))
    # the same test on seed-averaged curves
    averaged = {name: extrapolation_check(*t["curve"]) for name, t in table.items()}
    averaged = {name: x["error"] for name, x in averaged.items() if x}
    meta = dict(seeds=seeds, steps=steps, minutes=minutes, left_out=left_out, quick=quick,
                auc_to=auc_to)
    text = "\n".join(report_lines(out, tables, found, pred, averaged, meta)) + "\n"
    replace_file(os.path.join(out, "report.md"), lambda f: f.write(text))
    summary = summary_json(table, found, pred, averaged, meta)
    replace_file(os.path.join(out, "study_report.json"), lambda f: json.dump(summary, f, indent=1))
    draw(out, table)
    return text


def draw(out, table):
    """study.png and study_extrap.png."""
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
    save_figure(fig, ax, os.path.join(out, "study_extrap.png"), len(table))
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description="The miniature ScaleRL study on the toy-hard task.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", help="the study's folder (one sub-folder per run)")
    p.add_argument("--budget", type=float, default=150,
                   help="machine-minutes of runs: variants that would not fit are left out "
                        "(priority order: study.VARIANTS; all of them: ~147)")
    p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps per run")
    p.add_argument("--report", action="store_true",
                   help="only fit the runs in the folder and write the report")
    p.add_argument("--assets", default="",
                   help="also copy study_report.json, study.png, study_extrap.png here "
                        "(--assets assets replaces the committed ones)")
    p.add_argument("--quick", action="store_true",
                   help="3 variants x 1 seed x 6 tiny steps, an eval after each (the test's form)")
    args = p.parse_args(argv)
    variants, seeds, extra, steps, held_out = VARIANTS, SEEDS, [], args.steps, HELD_OUT
    if args.quick:
        variants = {n: VARIANTS[n] for n in ("scalerl", "batch32")}
        seeds, steps, held_out = (0,), 6, 8
        extra = ["--prompts", "4", "--samples", "4", "--eval_every", "1", "--eval_samples", "1"]
    report = os.path.join(args.assets, "study_report.json")
    if args.quick and args.assets and os.path.exists(report):
        with open(report) as f:
            if "note" not in json.load(f):
                sys.exit(f"study: --quick would replace the full study's report in {args.assets}; "
                         "give --quick another --assets")
    os.makedirs(args.out, exist_ok=True)
    if not args.report:
        again = shlex.join(["python", sys.argv[0] if argv is None else "study.py",
                            *(sys.argv[1:] if argv is None else argv)])
        train_all(args.out, variants, seeds, steps, args.budget, extra, held_out, again)
    names = [n for n in variants
             if all(finished(run_dir(args.out, n, s), steps) for s in seeds)]
    if not names:
        sys.exit(f"study: no variant has all {len(seeds)} seeds finished in {args.out}")
    minutes = sum(run_minutes(run_dir(args.out, n, s)) for n in names for s in seeds)
    print(write_report(args.out, names, seeds, steps, minutes,
                       [n for n in variants if n not in names], args.quick))
    written = ["report.md", "study_report.json", "study.png", "study_extrap.png"]
    if args.assets:
        os.makedirs(args.assets, exist_ok=True)
        for name in written[1:]:
            with open(os.path.join(args.out, name), "rb") as src:
                replace_file(os.path.join(args.assets, name), lambda f: shutil.copyfileobj(src, f),
                             "wb")
    print(f"wrote {', '.join(os.path.join(args.out, w) for w in written)}" +
          (f"; copied the last three to {args.assets}" if args.assets else ""))


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as err:  # one line, no traceback
        sys.exit(f"study: error: {err}")
