"""
The confirmatory miniature ScaleRL study: ScaleRL and the paper's variants on the embedded toy-hard
task, 5 fresh seeds each, every finding tested as the paper states it (superiority or
non-inferiority, Holm over all), and predictability by the paper's fit (arXiv 2510.13786, Eq. 1,
appendix A.5-A.7). The rules were frozen in docs/protocol.md before the runs. Start at VARIANTS,
FINDINGS and main. The second study (--figure2: FIGURE2, write_figure2_report) compares the recipes
of the paper's Figure 2 under docs/protocol-figure2.md, its length from simulate_power.

    python study.py runs/study                   # within --budget; Ctrl-C, then again: resumes
    python study.py runs/study --assets assets   # also replace the committed report and figures
    python study.py runs/study-quick --quick     # 2 variants x 1 seed x a few steps (the test)
    python study.py runs/figure2 --figure2       # the second study (docs/protocol-figure2.md)

Writes report.md, study_report.json, study.png and study_extrap.png into the study's folder
(--figure2: figure2.md, figure2_report.json, figure2.png).
"""
import argparse
import collections
import contextlib
import hashlib
import itertools
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from scipy import stats

from faults import printable
from runs import (checkpoints, copy_written, open_folder, open_run_file, read_json, read_jsonl,
                  replace_file)
from fit import (NOISE_A, check_points, checked_number, eval_point, finite, fit_sigmoid, plot,
                 sigmoid)
from plots import color, draw_extrapolation, save_figure
from toy import toy_model_dir, toy_problems

SEEDS = (10, 11, 12, 13, 14)  # fresh: the exploratory study used 0-4
HELD_OUT = 2000       # the same for every run
TRAIN = 1500
MAX_OPS = 6           # toy-hard's chains of 2 to 6 operations
# collapsed: a last eval this far under the run's best
COLLAPSE_DROP = 0.05
STEPS = 200
TASK = ["--think_budget", "64", "--lr", "2e-4", "--eval_every", "10", "--eval_samples", "1",
        "--save_every", "0"]
# train.py flags on ScaleRL's defaults, in the order they start under --budget
VARIANTS = {
    "scalerl": [],
    "no_zero_var": ["--no-zero_var_filter"],
    "no_npr": ["--no-no_positive_resampling"],
    "batch32": ["--prompts", "32"],
    "agg_sample": ["--agg", "sample"],
    "norm_prompt": ["--adv_norm", "prompt"],
}
# one-process runs side by side, one thread each, within BUDGET machine-minutes
PARALLEL = 2
BUDGET = 160
PROGRESS_S = 60
# the rules, frozen in PROTOCOL before the runs; a changed file is reported as changed
PROTOCOL = os.path.join("docs", "protocol.md")
SETTINGS = "settings.json"  # in the study's folder: the settings its runs were made with
# every commit of it, with the SHA-256 of the file as that commit holds it; the last one is in force
PROTOCOL_CHAIN = (
    ("1b3775dcd3ee9f7fb018dece064a487b41ec7f23",
     "2e5c4b86b135508340b516a0996d125f92a3f9ab542f9c00559af38dd18229de", "frozen before any run"),
    ("8a32913ea6451da06056275391062bf5a4ebc0e6",
     "ca1e5c06c1a4cd5bd3d21b2f41ffd6948b8976666c83308884a19dd7ba07f881",
     "amendment 1, before any run had finished: --budget 160"),
)
ALPHA = 0.05
MIN_PAIRS = 5
NI_MARGIN = 0.02
A_CAP = 1.0
A_CAP_TOL = 5e-4      # within this of A_CAP: at the cap
EARLY = 0.1           # evals before this share of a run's samples are not fitted
CUT = 0.5             # the prediction's cut, a share of the run's samples
CUTS = (0.4, CUT, 0.6, 0.75)  # the sensitivity, not tested
# (finding, the paper's claim, X, Y, kind); endpoint final_mean3 for all
FINDINGS = [
    ("zero-variance filtering", "filtering gives a higher asymptote (section 3.2)",
     "scalerl", "no_zero_var", "superiority"),
    ("No-Positive-Resampling", "a higher asymptote (section 3.2)",
     "scalerl", "no_npr", "superiority"),
    ("batch size", "a larger batch reaches a higher asymptote (section 5)",
     "batch32", "scalerl", "superiority"),
    ("loss aggregation", "the prompt average reaches the highest asymptote (section 3.2)",
     "scalerl", "agg_sample", "superiority"),
    ("advantage normalization", "the normalizations perform similarly (section 3.2)",
     "scalerl", "norm_prompt", "non-inferiority"),
]
# the second study, frozen in PROTOCOL2 before its runs: the recipes of the paper's Figure 2
PROTOCOL2 = os.path.join("docs", "protocol-figure2.md")
PROTOCOL2_CHAIN = (
    ("92e6094e37d01d5172b78c25a7b5321b4f111e97",
     "94f06ca1164c9a1b84b140885c3d7bb33c4b3f0baf7885100d70609edcc91b17", "frozen before any run"),
)
METHODS2 = ("scalerl", "grpo", "dapo", "magistral", "minimax")  # ranked by the fit at CUT
# one process each; pipeline8 and ppo8 (--mode) run two ranks (ranks_of)
FIGURE2 = {**{n: ["--method", n] for n in METHODS2},
           "pipeline8": ["--mode", "pipeline", "--max_lag", "8"],
           "ppo8": ["--mode", "ppo_offpolicy", "--max_lag", "8"]}
SEEDS2 = (20, 21, 22, 23, 24)  # fresh: the studies before used 0-4 and 10-14
STEPS2 = 600          # the shortest simulated length with 80% power (POWER)
EVAL_EVERY2 = 20
BUDGET2 = 720
A_RULE = 0.02         # the paper's noise on A: a difference within it is none
# simulate_power on the first study's fits, as the protocol records it (2,000 x 1 evals every 20)
POWER = tuple(dict(steps=n, evals=n // 20 + 1, power=p, rmse_fit=f, rmse_constant=c,
                   rmse_persistence=q, reps=60, seed=0)
              for n, p, f, c, q in ((200, 0.0, 0.0231, 0.0125, 0.1139),
                                    (400, 0.0833, 0.0108, 0.0121, 0.0307),
                                    (500, 0.1833, 0.0113, 0.0136, 0.0218),
                                    (600, 0.80, 0.0083, 0.0146, 0.0146),
                                    (700, 0.45, 0.0087, 0.0153, 0.0123),
                                    (800, 0.4667, 0.0073, 0.0156, 0.0100)))
NOT_TESTED = [
    ("CISPO vs DAPO", "two ranks a run, over the budget"),
    ("PipelineRL-8 vs PPO-off-policy-8 and vs the synchronous loop",
     "two ranks a run, over the budget"),
    ("interruptions vs a length penalty", "at a 64-token budget interruptions cut about 1% of "
     "samples, and a tighter budget was over the budget"),
    ("efficiency B", "no test was fixed for it"),
]
DETERMINISM = ("Determinism: a run repeats bit for bit on the same machine and thread count only. "
               "Across processors float-level differences grow: the exploratory study's scalerl "
               "seed 1, repeated on a second processor, ended 0.803 against 0.811 in final_mean3, "
               "so a difference of about 0.01 in one pair is within float-level spread.")
QUICK_NOTE = ("QUICK STUDY: a few tiny steps per run, to test the machinery; these numbers mean "
              "nothing.")

# -----------------------------------------------------------------------------
# the problems and the runs


def make_problems(out, held_out=HELD_OUT, max_ops=MAX_OPS):
    """The study's problem files (train, held-out), made once -> their paths."""
    folder = os.path.join(out, "problems")
    paths = os.path.join(folder, "train.jsonl"), os.path.join(folder, "val.jsonl")
    os.makedirs(out, exist_ok=True)
    os.close(open_folder(folder, make=True))  # never a link planted there
    if all(os.path.exists(p) for p in paths):
        return paths
    distinct = {}
    for p in toy_problems(20000, 777, "toy-hard"):
        if len(p["steps"]) <= max_ops:
            distinct.setdefault(p["prompt"], {"prompt": p["prompt"], "answer": p["answer"]})
    problems = list(distinct.values())
    random.Random(0).shuffle(problems)
    for path, rows in zip(paths, (problems[held_out:held_out + TRAIN], problems[:held_out])):
        replace_file(path, lambda f: f.writelines(json.dumps(r) + "\n" for r in rows))
    return paths


def study_settings(quick, variants, seeds, steps, held_out, extra):
    """What changes a study's runs: a folder holds the runs of one such set."""
    return dict(quick=quick, seeds=list(seeds), steps=steps, held_out=held_out, train=TRAIN,
                max_ops=MAX_OPS, task=TASK, extra=list(extra),
                variants={n: list(f) for n, f in variants.items()})


def keep_settings(out, made, write, other):
    """The folder's settings.json, written once (write) -> SystemExit naming what differs when the
    folder was made with other settings; `other`: the command for another folder."""
    path = os.path.join(out, SETTINGS)
    try:
        there = read_json(path, follow=False)
    except FileNotFoundError:
        if write:
            replace_file(path, lambda f: json.dump(made, f, indent=1))
        return
    if not isinstance(there, dict):
        raise ValueError(f"{path}: not a JSON object of settings")
    short = lambda v: str(v) if len(str(v)) <= 24 else "..."  # noqa: E731
    differs = [f"{k} ({short(there.get(k))} there, {short(made.get(k))} here)"
               for k in made if there.get(k) != made[k]]
    if differs:
        sys.exit(f"study: error: {out} holds a study made with other settings ({path}): "
                 f"{', '.join(differs)}; run this command in another folder: {other}")


def run_dir(out, name, seed):
    """out/NAME-sSEED, never a link planted there (train.py refuses one as --out too)."""
    path = os.path.join(out, f"{name}-s{seed}")
    if os.path.islink(path):
        sys.exit(f"study: error: {path} is a symlink: the study's run folders are its own, never "
                 "links; remove it")
    return path


def run_minutes(path):
    """A run's machine-minutes as train_all measured them, else 0 (OSError if not a file)."""
    try:
        minutes = read_json(os.path.join(path, "study_minutes.json"), follow=False)
    except (FileNotFoundError, ValueError):
        return 0.0
    return float(minutes) if finite(minutes) and minutes >= 0 else 0.0


def finished(path, steps):
    """Whether a run holds its last step's eval, or train.py stopped it (OSError if not a file)."""
    try:
        records = read_jsonl(os.path.join(path, "metrics.jsonl"), follow=False)
        return any(r.get("kind") == "stopped" or
                   (r.get("kind") == "eval" and r.get("step") == steps) for _, r in records)
    except (FileNotFoundError, ValueError):
        return False


def ranks_of(flags):
    """A run's processes: --mode applies under torchrun alone, so a variant setting it runs two
    ranks (a trainer and a generator) and takes both cores."""
    return 2 if "--mode" in flags else 1


def local_torchrun(ranks):
    """One machine's torchrun as the README's torchrun_local: listening on 127.0.0.1 alone, a fresh
    rendezvous file (without one torchrun warns of master_addr)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--rdzv-backend", "c10d", "--rdzv-conf", "store_type=file", "--rdzv-endpoint",
            os.path.join(tempfile.mkdtemp(), "rdzv"), "--local-addr", "127.0.0.1"]


def run_command(name, flags, path, seed, steps, data, extra):
    """train.py's command line for one run (--resume from a checkpoint)."""
    here = os.path.dirname(os.path.abspath(__file__))
    launcher = [sys.executable] if ranks_of(flags) == 1 else local_torchrun(2)
    return [*launcher, os.path.join(here, "train.py"), "--out", path,
            "--resume" if checkpoints(path) else "--overwrite",
            "--seed", str(seed), *task_flags(data, steps), *extra, *flags]


def task_flags(data, steps):
    """train.py's flags for the study's task."""
    return ["--steps", str(steps), "--model", toy_model_dir(preset="toy-hard"), "--data", data[0],
            "--val_data", data[1], *TASK]


def pace(minutes, name):
    """Expected machine-minutes of a run of `name`, from the finished runs, or None."""
    # not timed (0): says nothing of the pace
    own = [m for m in minutes.get(name, []) if m > 0]
    every = [m for v in minutes.values() for m in v if m > 0]
    return float(np.mean(own or every)) if every else None


def last_step(path):
    try:
        metrics = read_jsonl(os.path.join(path, "metrics.jsonl"), follow=False)
        return max((r.get("step", 0) for _, r in metrics), default=0)
    except (OSError, ValueError):
        return 0


def stop_runs(running, timeout=120):
    """SIGTERM to every running run, then wait for them."""
    for r in running:
        # SIGTERM: a run still starting (no handler yet) ends silently, not in a KeyboardInterrupt
        with contextlib.suppress(OSError, AttributeError):
            r["proc"].send_signal(signal.SIGTERM)
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


def run_starts(path):
    """A run's starts as the study recorded them ([{started, commit, dirty}]), else []."""
    try:
        starts = read_json(os.path.join(path, "study_run.json"), follow=False)
    except (FileNotFoundError, ValueError):
        return []
    return starts if isinstance(starts, list) and all(isinstance(s, dict) for s in starts) else []


def code_commit():
    """The code's git commit and whether its tracked files differ from it (None: not a checkout)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head, changed = (subprocess.run(["git", "-C", here, *words], capture_output=True, text=True,
                                        timeout=30, check=True).stdout.strip()
                         for words in (["rev-parse", "HEAD"],
                                       ["status", "--porcelain", "--untracked-files=no"]))
    except (OSError, subprocess.SubprocessError):
        return None, None
    return head, bool(changed)


def save_minutes(r, spent):
    """A run's machine-minutes so far and its starts (time, code commit), beside it (a continued
    run adds its own); none before its folder exists."""
    if os.path.isdir(r["path"]):
        replace_file(os.path.join(r["path"], "study_minutes.json"),
                     lambda f: json.dump(spent, f))
        replace_file(os.path.join(r["path"], "study_run.json"),
                     lambda f: json.dump(r["starts"], f, indent=1))


def start_run(out, name, flags, seed, steps, data, extra, expected):
    """Start train.py for (name, seed), continued from its checkpoints where it has some."""
    path = run_dir(out, name, seed)
    cmd = run_command(name, flags, path, seed, steps, data, extra)
    resume = "--resume" in cmd
    commit, dirty = code_commit()  # before the start: a Ctrl-C in it leaves no run behind
    log = open_run_file(os.path.join(out, f"{name}-s{seed}.log"), "a" if resume else "w")
    # its own session: the terminal's Ctrl-C reaches the study alone, which stops it (stop_runs)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=os.environ | {"OMP_NUM_THREADS": "1"})
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time()))
    return dict(name=name, seed=seed, path=path, proc=proc, log=log, slots=ranks_of(flags),
                start=time.time(), expected=expected or 0.0,
                before=run_minutes(path) if resume else 0.0, resume=resume,
                starts=(run_starts(path) if resume else []) +
                [dict(started=started, commit=commit, dirty=dirty)])


def stop_study(running, used, steps, again, why, code):
    """Stop the runs (each saves its step), say where each stopped and how to continue, exit."""
    stopped = list(running)
    stop_runs(running)
    for r in stopped:
        save_minutes(r, used(r))
        step, saved = last_step(r["path"]), (checkpoints(r["path"])[-1:] or ["nothing yet"])[0]
        by = "the study's Ctrl-C" if why == "interrupted" else f"the study ({why})"
        if "log" in r:  # the run's log ends with why, not with a traceback
            r["log"].write(f"study: {r['name']} seed {r['seed']} stopped by {by} at step "
                           f"{step}/{steps}; saved: {saved}; the same study command continues it\n")
            r["log"].close()
        print(f"study: {r['name']} seed {r['seed']} interrupted at step {step}/{steps}; saved: "
              f"{saved}", flush=True)
    print(f"study: {why}; continue with: {again or 'the same command'} (finished runs are "
          "kept, interrupted ones continue from their last checkpoint)", flush=True)
    sys.exit(code)


def train_all(out, variants, seeds, steps, budget_min, extra=(), held_out=HELD_OUT, again=None):
    """Train every unfinished (variant, seed) in priority order within the budget -> the variants
    left out."""
    data = make_problems(out, held_out)
    done = {(n, s) for n in variants for s in seeds if finished(run_dir(out, n, s), steps)}
    minutes = {n: [run_minutes(run_dir(out, n, s)) for s in seeds if (n, s) in done]
               for n in variants}
    pending = [(n, s) for n in variants for s in seeds if (n, s) not in done]
    t0, running, left_out, shown = time.time(), [], [], [time.time()]
    spent = lambda: sum(map(sum, minutes.values())) + sum(r["expected"] for r in running)
    used = lambda r: (time.time() - r["start"]) / 60 * r.get("slots", 1) / PARALLEL + r["before"]

    def projected(r):  # a run's machine-minutes at its end, at its pace so far
        step = last_step(r["path"])
        return used(r) * steps / step if step > 0 else None

    def eta():
        # before a run has ended: the running runs' own pace
        now = [p for p in map(projected, running) if p is not None]
        guess = float(np.mean(now)) if now else None
        paces = [pace(minutes, n) or guess for n, _ in pending]
        own = [projected(r) or r["expected"] or pace(minutes, r["name"]) or guess for r in running]
        if None in paces + own:
            return "an ETA once a run has logged a step"
        left = sum(paces) + sum(max(0.0, o - used(r)) for r, o in zip(running, own))
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
                if code in (130, 143, -2, -15):
                    stop(f"{r['name']} seed {r['seed']} was stopped by a signal", 130)
                if code:
                    stop(f"{r['name']} seed {r['seed']} failed (exit {code}; its log: "
                         f"{r['log'].name})", 1)
                spent_r = used(r)
                minutes[r["name"]].append(spent_r)
                save_minutes(r, spent_r)
                print(f"study: {r['name']} seed {r['seed']} done in {spent_r:.1f} machine-min | "
                      f"{eta()}", flush=True)
            if PARALLEL - sum(r.get("slots", 1) for r in running) >= free:
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
                wait(ranks_of(flags))
                pending.remove((name, seed))
                running.append(r := start_run(out, name, flags, seed, steps, data, extra,
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
# fitting and judging, as docs/protocol.md fixed them


NUMBERS = ("pass_rate_se", "intr", "trunc", "len", "lag", "retired", "epoch", "dropped_zero_var",
           "prompts")


def run_logs(path):
    """A run's last eval's standard error and what its knobs did (means; NaN where not logged)."""
    file = os.path.join(path, "metrics.jsonl")
    # checked: finite, or ValueError file:line
    records = [{k: checked_number(r, k, f"{file}:{i}")
                if k in NUMBERS and r.get("kind") in ("train", "eval") else v
                for k, v in r.items()} for i, r in read_jsonl(file, follow=False)]
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


def run_series(path):
    """A run's evals -> [{step, samples, flops, compute_s, pass_rate}]; samples = step x prompts x
    samples per prompt, the protocol's compute axis."""
    file = os.path.join(path, "metrics.jsonl")
    per_step, series = None, []
    for i, r in read_jsonl(file, follow=False):
        where = f"{file}:{i}"
        if r.get("kind") == "config":
            per_step = checked_number(r, "prompts", where) * checked_number(r, "samples", where)
        elif r.get("kind") == "eval":
            if per_step is None:
                raise ValueError(f"{where}: an eval before the run's config line")
            step, flops, compute_s = (checked_number(r, k, where)
                                      for k in ("step", "flops", "compute_s"))
            series.append(dict(step=int(step), samples=step * per_step, flops=flops,
                               compute_s=compute_s,
                               pass_rate=eval_point(r, "step", "pass_rate", where)[1]))
    return series


def sd(values):
    """Sample standard deviation (ddof 1); NaN under 2 values."""
    return float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")


def at_cap(A):
    return bool(A >= A_CAP - A_CAP_TOL)


def predict(C, R, cut):
    """Eq. 1 fitted to the evals from EARLY to `cut` of the run's compute -> its final_mean3
    predicted and the persistence guess, or None (too few points to fit)."""
    upto = C <= cut * C[-1] * (1 + 1e-12)
    try:
        f = fit_sigmoid(C[upto], R[upto], R0=R[0], fit_from=EARLY * C[-1])
    except ValueError:
        return None
    return dict(cut=cut, points=int((upto & (C > 0) & (C >= EARLY * C[-1])).sum()),
                predicted=float(np.mean(sigmoid(C[-3:], f["A"], f["B"], f["C_mid"], R[0]))),
                persistence=float(np.mean(R[upto][-3:])), A=f["A"], B=f["B"], C_mid=f["C_mid"])


def analyze(out, names, seeds):
    """Fit every run on the samples axis -> ({variant: its runs and means}, the shared A)."""
    table = {}
    for name in names:
        runs = []
        for s in seeds:
            path = run_dir(out, name, s)
            series = run_series(path)
            C, R = check_points([e["samples"] for e in series], [e["pass_rate"] for e in series])
            collapsed = bool(R[-1] < R.max() - COLLAPSE_DROP)
            fit = fit_sigmoid(C, R, fit_from=EARLY * C[-1])
            se, training = run_logs(path)
            runs.append(dict(seed=s, C=C, R=R, series=series, fit=fit, se=se,
                             starts=run_starts(path),
                             collapsed=collapsed, training=training,
                             final_mean3=float(np.mean(R[-3:])),
                             predictions={cut: None if collapsed else predict(C, R, cut)
                                          for cut in CUTS}))
        table[name] = runs
    shared_A = float(np.mean([r["fit"]["A"] for runs in table.values() for r in runs]))
    for name, runs in table.items():
        for r in runs:
            r["refit"] = fit_sigmoid(r["C"], r["R"], R0=r["fit"]["R0"], fit_from=EARLY * r["C"][-1],
                                     A=shared_A)
        n = min(len(r["C"]) for r in runs)
        A, B = [r["fit"]["A"] for r in runs], [r["refit"]["B"] for r in runs]
        finals = [r["final_mean3"] for r in runs]
        table[name] = dict(
            runs=runs, A=float(np.mean(A)), A_sd=sd(A), B=float(np.mean(B)), B_sd=sd(B),
            C_mid=float(10 ** np.mean([np.log10(r["refit"]["C_mid"]) for r in runs])),
            final_mean3=float(np.mean(finals)), final_mean3_sd=sd(finals),
            se=float(np.nanmean([r["se"] for r in runs])) if any(
                np.isfinite(r["se"]) for r in runs) else float("nan"),
            R0=float(np.mean([r["fit"]["R0"] for r in runs])),
            curve=(np.mean([r["C"][:n] for r in runs], 0), np.mean([r["R"][:n] for r in runs], 0)))
    return table, shared_A


def one_sided_p(d, shift):
    """p of a one-sided t-test of mean(d) > shift; NaN under 2 values."""
    d = np.asarray(d, dtype=float)
    if len(d) < 2:
        return float("nan")
    if np.ptp(d) == 0:  # no spread: the sign alone decides
        return 0.0 if d[0] > shift else 1.0
    return float(stats.ttest_1samp(d, shift, alternative="greater").pvalue)


def holm(p):
    """Holm's step-down adjusted p-values, in p's order (NaN stays NaN)."""
    order = sorted((v, i) for i, v in enumerate(p) if v == v)
    out, running = [float("nan")] * len(p), 0.0
    for k, (v, i) in enumerate(order):
        running = max(running, min(1.0, (len(order) - k) * v))
        out[i] = running
    return out


def verdict(kind, p_holm, pairs):
    """The words the test allows."""
    if pairs < MIN_PAIRS or p_holm != p_holm:
        return f"not decided (fewer than {MIN_PAIRS} pairs)"
    if kind == "superiority":
        return "superiority shown" if p_holm <= ALPHA else "superiority not shown"
    return (f"a loss larger than {NI_MARGIN} excluded" if p_holm <= ALPHA else
            f"a loss larger than {NI_MARGIN} not excluded")


def judge_findings(table):
    """Every finding whose two arms ran: its paired test, Holm over all of them."""
    found = []
    for name, claim, X, Y, kind in FINDINGS:
        if X not in table or Y not in table:
            continue
        by_seed = [{r["seed"]: r["final_mean3"] for r in table[v]["runs"]} for v in (X, Y)]
        seeds = sorted(set(by_seed[0]) & set(by_seed[1]))
        x, y = ([b[s] for s in seeds] for b in by_seed)
        d = np.subtract(x, y)
        shift = 0.0 if kind == "superiority" else -NI_MARGIN
        half = (stats.t.ppf(0.975, len(d) - 1) * sd(d) / np.sqrt(len(d)) if len(d) > 1
                else float("nan"))
        found.append(dict(name=f"{name}: {X} vs {Y}", finding=name, paper=claim, kind=kind, X=X,
                          Y=Y, endpoint="final_mean3", margin=0.0 if kind == "superiority" else
                          NI_MARGIN, pairs=len(seeds), seeds=seeds, x=x, y=y,
                          mean_diff=float(np.mean(d)) if len(d) else float("nan"), sd_diff=sd(d),
                          ci95=[float(np.mean(d) - half), float(np.mean(d) + half)] if len(d)
                          else None, p=one_sided_p(d, shift)))
    for f, p in zip(found, holm([f["p"] for f in found])):
        f["p_holm"] = p
        f["verdict"] = verdict(f["kind"], p, f["pairs"])
    return found


def predictability(table, cut):
    """The fit's predictions at `cut` against persistence and the constant baseline."""
    runs = [r for t in table.values() for r in t["runs"]]
    finals = np.array([r["final_mean3"] for r in runs])
    rows = [(r["predictions"][cut], r["final_mean3"], (finals.sum() - r["final_mean3"]) /
             max(len(runs) - 1, 1)) for r in runs if r["predictions"][cut]]
    out = dict(cut=cut, n=len(rows))
    measured = np.array([m for _, m, _ in rows])
    for tag, guess in (("fit", [p["predicted"] for p, _, _ in rows]),
                       ("persistence", [p["persistence"] for p, _, _ in rows]),
                       ("constant", [c for _, _, c in rows])):
        err = np.asarray(guess, dtype=float) - measured
        out[f"rmse_{tag}"] = float(np.sqrt(np.mean(err ** 2))) if rows else None
        out[f"within_{tag}"] = int((abs(err) <= NOISE_A).sum())
        out[f"mean_error_{tag}"] = float(np.mean(err)) if rows else None
    out["skill"] = bool(rows and out["rmse_fit"] < min(out["rmse_persistence"],
                                                        out["rmse_constant"]))
    return out


def skill_test(fit_sq, constant_sq, persistence_sq):
    """The paired skill test: the fit's squared errors below the constant's and below
    persistence's, each a one-sided paired t-test; skill shown when both p <= ALPHA."""
    p_constant = one_sided_p(np.subtract(constant_sq, fit_sq), 0.0)
    p_persistence = one_sided_p(np.subtract(persistence_sq, fit_sq), 0.0)
    return dict(p_constant=p_constant, p_persistence=p_persistence,
                skill=bool(p_constant <= ALPHA and p_persistence <= ALPHA))


def squared_errors(C, curves):
    """Each run's squared errors at CUT (fit, constant, persistence) from its evals, the runs
    that could be fitted -> dict of lists."""
    finals = np.array([np.mean(R[-3:]) for R in curves])
    err = {"fit": [], "constant": [], "persistence": []}
    for i, R in enumerate(curves):
        p = predict(C, R, CUT)
        if p:
            err["fit"].append((p["predicted"] - finals[i]) ** 2)
            err["persistence"].append((p["persistence"] - finals[i]) ** 2)
            err["constant"].append(((finals.sum() - finals[i]) / (len(curves) - 1)
                                    - finals[i]) ** 2)
    return err


def simulate_power(truth, steps, eval_every=20, n_eval=HELD_OUT, per_step=128, reps=50, seed=0):
    """The skill test's power by simulation: each truth (A, B, C_mid on samples, R0) a run's
    sigmoid, an eval every `eval_every` steps drawn binomially from `n_eval` answers, fitted from
    EARLY to CUT of the run -> the share of simulated studies that show skill and the mean RMSEs."""
    rng = np.random.default_rng(seed)
    C = np.arange(0, steps + 1, eval_every) * float(per_step)
    means = [np.clip(sigmoid(C, t["A"], t["B"], t["C_mid"], t["R0"]), 0, 1) for t in truth]
    shown, rmse = 0, {"fit": [], "constant": [], "persistence": []}
    for _ in range(reps):
        err = squared_errors(C, [rng.binomial(n_eval, m) / n_eval for m in means])
        shown += skill_test(err["fit"], err["constant"], err["persistence"])["skill"]
        for k, v in err.items():
            rmse[k].append(float(np.sqrt(np.mean(v))))
    return dict(steps=steps, eval_every=eval_every, n_eval=n_eval, runs=len(truth), reps=reps,
                seed=seed, power=shown / reps,
                **{f"rmse_{k}": float(np.mean(v)) for k, v in rmse.items()})


def first_study_truth(report):
    """The first study's non-collapsed runs' full fits (study_report.json) -> simulate_power's
    truth."""
    return [dict(A=r["A"], B=r["B"], C_mid=r["C_mid"], R0=r["R0"]) for r in report["runs"]
            if not r["collapsed"]]


def protocol_record(path=PROTOCOL, chain=PROTOCOL_CHAIN):
    """The protocol's path, its chain of commits (each with its file's SHA-256), today's SHA-256
    and whether it is still the last one frozen."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, path), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return dict(path=path, chain=[dict(commit=c, sha256=h, what=w) for c, h, w in chain],
                sha256=digest, frozen=digest == chain[-1][1])

# -----------------------------------------------------------------------------
# the report


def show(v, spec=".3g"):
    return "-" if v is None or v != v else format(v, spec)


def variant_rows(table):
    rows = ["| variant | flags | seeds | final_mean3 | sd | A | A sd | A at cap | eval se | "
            "B (shared A) | B sd | C_mid (samples, shared A) | R0 | collapsed |",
            "|---" * 14 + "|"]
    for name, t in table.items():
        capped = sum(at_cap(r["fit"]["A"]) for r in t["runs"])
        rows.append(f"| {name} | `{' '.join(VARIANTS.get(name, [])) or '(ScaleRL)'}` | "
                    f"{len(t['runs'])} | {t['final_mean3']:.3f} | "
                    f"{show(t['final_mean3_sd'], '.3f')} | {t['A']:.3f} | "
                    f"{show(t['A_sd'], '.3f')} | {capped} | {show(t['se'], '.3f')} | "
                    f"{t['B']:.2f} | {show(t['B_sd'], '.2f')} | {t['C_mid']:.3g} | {t['R0']:.3f} | "
                    f"{sum(r['collapsed'] for r in t['runs'])} |")
    return rows


def training_rows(table):
    """What each variant's knobs did in training (seed means)."""
    rows = ["| variant | interrupted | truncated | zero-variance prompts dropped | length | "
            "retired by NPR at the end | last epoch |", "|---" * 7 + "|"]
    for name, t in table.items():
        m = {k: np.mean([r["training"][k] for r in t["runs"]]) for k in t["runs"][0]["training"]}
        rows.append(f"| {name} | {show(m['interrupted'], '.1%')} | {show(m['truncated'], '.1%')} | "
                    f"{show(m['zero_var'], '.0%')} | {show(m['length'], '.1f')} | "
                    f"{show(m['retired'], '.0f')} | {show(m['epoch'], '.1f')} |")
    return rows


def findings_lines(found):
    lines = ["| finding | the paper | kind | pairs | X - Y (sd) | 95% interval | p | p (Holm) | "
             "result |", "|---" * 9 + "|"]
    return lines + [
        f"| {f['name']} | {f['paper']} | {f['kind']} | {f['pairs']} | {f['mean_diff']:+.3f} "
        f"({show(f['sd_diff'], '.3f')}) | {show(f['ci95'][0], '+.3f')} to "
        f"{show(f['ci95'][1], '+.3f')} | {show(f['p'])} | {show(f['p_holm'])} | "
        f"**{f['verdict']}** |" for f in found]


def predictability_lines(preds):
    lines = ["| cut (share of samples) | runs | fit RMSE | persistence RMSE | constant RMSE | "
             "within 0.02: fit, persistence, constant | fit's mean error | skill |",
             "|---" * 8 + "|"]
    return lines + [
        f"| {p['cut']:g} | {p['n']} | {show(p['rmse_fit'], '.4f')} | "
        f"{show(p['rmse_persistence'], '.4f')} | {show(p['rmse_constant'], '.4f')} | "
        f"{p['within_fit']}, {p['within_persistence']}, {p['within_constant']} | "
        f"{show(p['mean_error_fit'], '+.3f')} | {'yes' if p['skill'] else 'no'} |" for p in preds]


def skill_sentence(p):
    if not p["n"]:
        return "No run could be checked: none has enough points before the cut."
    return (f"At the protocol's cut ({p['cut']:g} of the samples), the fit "
            + ("has skill: its RMSE is below both baselines'." if p["skill"] else
               "has no skill: its RMSE is not below both baselines' (persistence "
               f"{p['rmse_persistence']:.4f}, constant {p['rmse_constant']:.4f}, the fit "
               f"{p['rmse_fit']:.4f})."))


def report_lines(out, table, found, preds, meta):
    """report.md's lines."""
    runs = [r | {"variant": name} for name, t in table.items() for r in t["runs"]]
    collapsed = [f"{r['variant']}-s{r['seed']}" for r in runs if r["collapsed"]]
    main_cut = next(p for p in preds if p["cut"] == CUT)
    proto = meta["protocol"]
    lines = ([QUICK_NOTE, ""] if meta["quick"] else []) + [
        f"# The {'quick' if meta['quick'] else 'confirmatory miniature ScaleRL'} study: "
        f"{len(table)} variants x {len(meta['seeds'])} seeds, {len(runs)} runs of {meta['steps']} "
        "steps", "",
        f"Written by `python study.py {out}{' --quick' if meta['quick'] else ''}`" +
        (f" after {meta['minutes']:.0f} machine-minutes of runs." if meta["minutes"] else "."),
        f"Protocol: {proto['path']} ("
        + "; ".join(f"{c['what']}: commit {c['commit'][:12]}, sha256 {c['sha256'][:12]}"
                    for c in proto["chain"])
        + f"{'' if proto['frozen'] else '; CHANGED since it was last frozen'}). "
        f"Seeds {', '.join(map(str, meta['seeds']))}. Collapsed runs: "
        f"{', '.join(collapsed) or 'none'}." +
        (f" Not run (over the budget): {', '.join(meta['left_out'])}." if meta["left_out"]
         else ""), "",
        "## The paper's findings, tested as it states them", "",
        "Endpoint final_mean3 (the mean of a run's last three evals); one-sided paired t-tests; "
        f"superiority: X - Y > 0; non-inferiority: X - Y > -{NI_MARGIN}; Holm over the "
        f"{len(found)} findings below, family-wise {ALPHA}.", ""] + findings_lines(found) + [
        "", "Not tested: " + "; ".join(f"{n} ({why})" for n, why in NOT_TESTED) + ".", "",
        "## Per variant (compute: samples generated)", ""] + variant_rows(table) + [
        "", "## What the knobs did in training (seed means; shares over the steps)", ""
        ] + training_rows(table) + [
        "", "## Predictability, the paper's method (docs/protocol.md)", "",
        f"Eq. 1 fitted to each run's evals from {EARLY:g} of its samples to the cut, predicting "
        "its final_mean3; persistence: the mean of the last three evals before the cut; constant: "
        "the mean final_mean3 of every other run. " + skill_sentence(main_cut), ""
        ] + predictability_lines(preds) + ["", DETERMINISM]
    return lines


def clean(v):
    """v made JSON-safe: NaN -> null, numpy numbers -> plain."""
    if isinstance(v, dict):
        return {str(k): clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean(x) for x in v]
    if isinstance(v, (float, np.floating)):
        return None if v != v else float(v)
    return int(v) if isinstance(v, np.integer) else v


def summary_json(table, found, preds, meta):
    runs = [r | {"variant": name} for name, t in table.items() for r in t["runs"]]
    summary = {
        "protocol": meta["protocol"],
        "findings": found,
        "not_tested": [dict(finding=n, why=why) for n, why in NOT_TESTED],
        "predictability": dict(compute="samples generated: steps x prompts x samples per prompt",
                               early=EARLY, cut=CUT, by_cut=preds,
                               skill=next(p for p in preds if p["cut"] == CUT)["skill"]),
        "runs": [{"variant": r["variant"], "seed": r["seed"], "final": float(r["R"][-1]),
                  "final_mean3": r["final_mean3"], "A": r["fit"]["A"],
                  "A_at_cap": at_cap(r["fit"]["A"]), "B": r["fit"]["B"],
                  "C_mid": r["fit"]["C_mid"], "R0": r["fit"]["R0"], "collapsed": r["collapsed"],
                  "eval_se": r["se"], "training": r["training"],
                  "predictions": list(r["predictions"].values()), "series": r["series"],
                  "starts": r["starts"]}
                 for r in runs],
        "minutes": round(meta["minutes"], 1) if meta["minutes"] else None,
        "steps": meta["steps"], "seeds": list(meta["seeds"]), "left_out": list(meta["left_out"]),
        "A_cap": A_CAP, "determinism": DETERMINISM,
        "statistics": {"test": "one-sided paired t (scipy.stats.ttest_1samp on X - Y)",
                       "alpha": ALPHA, "correction": "Holm", "min_pairs": MIN_PAIRS,
                       "ni_margin": NI_MARGIN, "ddof": 1},
        "quick": meta["quick"]}
    return clean({"note": QUICK_NOTE, **summary} if meta["quick"] else summary)


def write_report(out, names, seeds, steps, minutes=None, left_out=(), quick=False):
    """Fit, judge and write report.md, study_report.json and the figures -> the report."""
    table, _ = analyze(out, names, seeds)
    found = judge_findings(table)
    preds = [predictability(table, cut) for cut in CUTS]
    meta = dict(seeds=seeds, steps=steps, minutes=minutes, left_out=left_out, quick=quick,
                protocol=protocol_record())
    text = "\n".join(report_lines(out, table, found, preds, meta)) + "\n"
    replace_file(os.path.join(out, "report.md"), lambda f: f.write(text))
    summary = summary_json(table, found, preds, meta)
    replace_file(os.path.join(out, "study_report.json"), lambda f: json.dump(summary, f, indent=1))
    draw(out, table)
    return text


def draw(out, table):
    """study.png (seed-averaged curves and fits) and study_extrap.png (each run's fit up to the
    protocol's cut, extrapolated)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pooled = []
    for name, t in table.items():
        C, R = t["curve"]
        start = EARLY * C[-1]
        pooled.append(dict(run=name, C=C, R=R, used=(C > 0) & (C >= start),
                           fit=fit_sigmoid(C, R, fit_from=start), compute="samples generated",
                           metric=f"held-out pass rate ({HELD_OUT} prompts)"))
    plot(pooled, os.path.join(out, "study.png"), os.path.join(out, "study_linear.png"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (name, t) in enumerate(table.items()):
        col = color(plt, k, len(table))
        for r in t["runs"]:
            C, R, p = r["C"], r["R"], r["predictions"][CUT]
            ax.scatter(C[C > 0], R[C > 0], s=4, color=col, alpha=0.4)
            if p:
                grid = np.geomspace(EARLY * C[-1], C[-1], 100)
                ax.plot(grid, sigmoid(grid, p["A"], p["B"], p["C_mid"], R[0]), "--", lw=0.8,
                        color=col, label=name if r["seed"] == t["runs"][0]["seed"] else None)
    ax.set(xscale="log", xlabel="compute (samples generated)", ylabel="held-out pass rate",
           title=f"each run fitted up to {CUT:g} of its samples, extrapolated to its end")
    save_figure(fig, ax, os.path.join(out, "study_extrap.png"), len(table))
    plt.close(fig)


# -----------------------------------------------------------------------------
# the second study: the paper's Figure 2 in miniature (docs/protocol-figure2.md)


def spearman_test(x, y):
    """Spearman's rho of x and y and its exact one-sided p (rho this high or higher over every
    order of y; ties none in practice) -> (rho, p)."""
    rank = lambda v: np.argsort(np.argsort(v))  # noqa: E731
    rx, ry = rank(x), rank(y)
    rho = lambda order: float(np.corrcoef(rx, order)[0, 1]) if len(rx) > 1 else float("nan")  # noqa
    if len(rx) < 2:
        return float("nan"), float("nan")
    every = [rho(np.array(o)) for o in itertools.permutations(ry)]
    got = rho(ry)
    return got, float(np.mean([r >= got - 1e-12 for r in every]))


def mean_interval(values):
    """(mean, 95% t interval over the values; NaN under 2)."""
    v = np.asarray(values, dtype=float)
    half = stats.t.ppf(0.975, len(v) - 1) * sd(v) / np.sqrt(len(v)) if len(v) > 1 else float("nan")
    return float(np.mean(v)), [float(np.mean(v) - half), float(np.mean(v) + half)]


def a_rule(table, X, Y):
    """The paper's rule on A: X's A against Y's, seed by seed; beyond +-A_RULE a difference,
    within it none."""
    by_seed = [{r["seed"]: r["fit"]["A"] for r in table[v]["runs"]} for v in (X, Y)]
    seeds = sorted(set(by_seed[0]) & set(by_seed[1]))
    d, ci = mean_interval([by_seed[0][s] - by_seed[1][s] for s in seeds])
    word = (f"higher by more than {A_RULE}" if d > A_RULE else f"lower by more than {A_RULE}"
            if d < -A_RULE else f"within +-{A_RULE}")
    return dict(X=X, Y=Y, pairs=len(seeds), diff_A=d, ci95=ci, verdict=word)


def figure2_tests(table):
    """The protocol's tests: skill (paired, at CUT), ranking (the fit at CUT against the
    endpoints, over the methods) and the +-A_RULE rule on A."""
    runs = [r for t in table.values() for r in t["runs"]]
    finals = np.array([r["final_mean3"] for r in runs])
    err = {"fit": [], "constant": [], "persistence": []}
    for r in runs:
        p = r["predictions"][CUT]
        if p:
            m = r["final_mean3"]
            err["fit"].append((p["predicted"] - m) ** 2)
            err["persistence"].append((p["persistence"] - m) ** 2)
            err["constant"].append(((finals.sum() - m) / max(len(runs) - 1, 1) - m) ** 2)
    skill = dict(n=len(err["fit"]), **{f"rmse_{k}": float(np.sqrt(np.mean(v))) if v else None
                                       for k, v in err.items()},
                 **skill_test(err["fit"], err["constant"], err["persistence"]))
    methods = [n for n in METHODS2 if n in table and all(r["predictions"][CUT]
                                                         for r in table[n]["runs"])]
    predicted = [np.mean([r["predictions"][CUT]["predicted"] for r in table[n]["runs"]])
                 for n in methods]
    measured = [table[n]["final_mean3"] for n in methods]
    rho, p = spearman_test(predicted, measured)
    ranking = dict(methods=methods, predicted=predicted, measured=measured, rho=rho, p=p,
                   verdict="the fit orders the methods as their ends" if p <= ALPHA else
                   "an order not shown" if p == p else "not decided (fewer than 2 methods)")
    pairs = [(n, "scalerl") for n in METHODS2 if n != "scalerl"] + [("pipeline8", "ppo8")]
    return skill, ranking, [a_rule(table, X, Y) for X, Y in pairs if X in table and Y in table]


def recipe_rows(table):
    """Per recipe: final_mean3, A, B, C_mid, each a seed mean with its 95% interval."""
    rows = []
    for name, t in table.items():
        row = dict(recipe=name, flags=FIGURE2.get(name, []), seeds=len(t["runs"]))
        for key in ("final_mean3", "A", "B", "C_mid"):
            row[key], row[f"{key}_ci95"] = mean_interval(
                [r["final_mean3"] if key == "final_mean3" else r["fit"][key] for r in t["runs"]])
        rows.append(row)
    return rows


def write_figure2_report(out, names, seeds, steps, minutes=None, quick=False):
    """The second study's report: figure2.md, figure2_report.json, figure2.png -> its text."""
    table, _ = analyze(out, names, seeds)
    skill, ranking, a_rules = figure2_tests(table)
    rows = recipe_rows(table)
    proto = protocol_record(PROTOCOL2, PROTOCOL2_CHAIN)
    head = f"The {'quick' if quick else 'second confirmatory'} study: the paper's Figure 2"
    gone = [f"{n}-s{r['seed']}" for n, t in table.items() for r in t["runs"] if r["collapsed"]]
    collapsed = f"; collapsed, so left out: {', '.join(gone)}" if gone else ""
    planned = [row["power"] for row in POWER if row["steps"] == steps]
    power = (f" (its power at {steps} steps, by the protocol's simulation: {planned[0]:.2f})"
             if planned else "")
    commits = collections.Counter(" ".join(sorted({st.get("commit") or "unknown"
                                                   for st in r["starts"]})) or "unknown"
                                  for t in table.values() for r in t["runs"])
    text = "\n".join(([QUICK_NOTE, ""] if quick else []) + [
        f"# {head} in miniature, {len(table)} recipe{'s' * (len(table) > 1)} x {len(seeds)} "
        f"seed{'s' * (len(seeds) > 1)}, {steps} steps", "",
        f"Written by `python study.py {out} --figure2{' --quick' if quick else ''}`" +
        (f" after {minutes:.0f} machine-minutes of runs." if minutes else ".") + " Protocol: " +
        "; ".join(f"{c['what']}: commit {c['commit'][:12]}, sha256 {c['sha256'][:12]}"
                  for c in proto["chain"]) + ("" if proto["frozen"] else "; CHANGED since"), "",
        "One process a run for the methods: --mode applies under torchrun alone, so each ran "
        "synchronous and on-policy whatever its --method says of the mode; pipeline8 against ppo8 "
        "(two ranks each) is the off-policy pair.", "",
        "Seed means, each with its 95% t interval over the seeds:", "",
        "| recipe | seeds | final_mean3 | A | B | C_mid (samples) |", "|---" * 6 + "|"] + [
        f"| {r['recipe']} | {r['seeds']} | " + " | ".join(
            f"{r[k]:{spec}} ({show(r[k + '_ci95'][0], spec)} to {show(r[k + '_ci95'][1], spec)})"
            for k, spec in (("final_mean3", ".3f"), ("A", ".3f"), ("B", ".2f"), ("C_mid", ".3g")))
        + " |" for r in rows] + [
        "", f"Skill at {CUT:g} of the compute ({skill['n']} runs{collapsed}): fit RMSE "
        f"{show(skill['rmse_fit'], '.4f')}, constant {show(skill['rmse_constant'], '.4f')}, "
        f"persistence {show(skill['rmse_persistence'], '.4f')}; one-sided paired p, fit against "
        f"the constant {show(skill['p_constant'])}, against persistence "
        f"{show(skill['p_persistence'])}: " + ("skill shown" if skill["skill"] else
                                               "no skill shown") + power + ".",
        f"Ranking: Spearman {show(ranking['rho'], '.2f')} (exact p {show(ranking['p'])}): "
        f"{ranking['verdict']}.", "", "A, the paper's rule (+-0.02): " +
        ("; ".join(f"{a['X']} vs {a['Y']} {a['diff_A']:+.3f}: {a['verdict']}" for a in a_rules)
         or "no pair of recipes yet") + ".", "",
        "The runs' code: " + ", ".join(f"{c[:12]} ({n} runs)" for c, n in commits.items()) + "."])
    text += "\n"
    replace_file(os.path.join(out, "figure2.md"), lambda f: f.write(text))
    runs = [{"recipe": n, "seed": r["seed"], "final_mean3": r["final_mean3"], "A": r["fit"]["A"],
             "B": r["fit"]["B"], "C_mid": r["fit"]["C_mid"], "R0": r["fit"]["R0"],
             "collapsed": r["collapsed"], "predictions": list(r["predictions"].values()),
             "series": r["series"], "starts": r["starts"],
             "minutes": run_minutes(run_dir(out, n, r["seed"]))}
            for n, t in table.items() for r in t["runs"]]
    summary = clean(dict(protocol=proto, power=list(POWER), skill=skill, ranking=ranking,
                         a_rule=a_rules, recipes=rows, runs=runs, steps=steps, seeds=list(seeds),
                         minutes=minutes, quick=quick, **({"note": QUICK_NOTE} if quick else {})))
    replace_file(os.path.join(out, "figure2_report.json"),
                 lambda f: json.dump(summary, f, indent=1))
    curves = []
    for name, t in table.items():  # the seed means, fitted up to the cut
        C, R = t["curve"]
        p = predict(C, R, CUT)
        curves.append(dict(name=name, C=C, R=R, fit_from=EARLY * C[-1], curve=p and (
            lambda x, p=p, R0=R[0]: sigmoid(x, p["A"], p["B"], p["C_mid"], R0))))
    draw_extrapolation(curves, os.path.join(out, "figure2.png"), CUT, "compute (samples generated)",
                       f"held-out pass rate ({HELD_OUT} problems)",
                       f"each recipe fitted up to {CUT:g} of its compute, extrapolated (dashed)")
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description="The miniature ScaleRL study on the toy-hard task.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", help="the study's folder (one sub-folder per run)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"machine-minutes of runs (the protocol's; None: {BUDGET:g}, --figure2 "
                        f"{BUDGET2:g}): variants that would not fit are not run (in the order of "
                        "study.VARIANTS or FIGURE2)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps per run (None: {STEPS}, --figure2 {STEPS2})")
    p.add_argument("--report", action="store_true",
                   help="only fit the runs in the folder and write the report")
    p.add_argument("--assets", default="",
                   help="also copy study_report.json, study.png, study_extrap.png here "
                        "(--figure2: figure2_report.json, figure2.png; --assets assets replaces "
                        "the committed ones)")
    p.add_argument("--quick", action="store_true",
                   help="2 variants x 1 seed x 6 tiny steps (or --steps), an eval after each (the test's "
                        "form)")
    p.add_argument("--figure2", action="store_true",
                   help="the second study (docs/protocol-figure2.md): the recipes of the paper's "
                        f"Figure 2 (FIGURE2), seeds {SEEDS2[0]}-{SEEDS2[-1]}, {STEPS2} steps, an "
                        f"eval every {EVAL_EVERY2}; writes figure2.md, figure2_report.json and "
                        "figure2.png")
    args = p.parse_args(argv)
    # as Ctrl-C: the runs (own sessions) stop too; SIGINT as well, which a study started in the
    # background (nohup ... &) inherits ignored
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    variants, seeds, extra, steps, held_out = VARIANTS, SEEDS, [], args.steps or STEPS, HELD_OUT
    if args.figure2:
        variants, seeds, steps = FIGURE2, SEEDS2, args.steps or STEPS2
        extra = ["--eval_every", str(EVAL_EVERY2)]
    if args.quick:
        variants = {n: variants[n] for n in (("scalerl", "dapo") if args.figure2 else
                                             ("scalerl", "batch32"))}
        seeds, steps, held_out = (0,), args.steps or 6, 8
        extra = ["--prompts", "4", "--samples", "4", "--eval_every", "1", "--eval_samples", "1"]
    budget = args.budget or (BUDGET2 if args.figure2 else BUDGET)
    written = (["figure2.md", "figure2_report.json", "figure2.png"] if args.figure2 else
               ["report.md", "study_report.json", "study.png", "study_extrap.png"])
    report = os.path.join(args.assets, written[1])
    if args.quick and args.assets and os.path.exists(report) and "note" not in read_json(report):
        sys.exit(f"study: --quick would replace the full study's report in {args.assets}; "
                 "give --quick another --assets")
    words = sys.argv[1:] if argv is None else list(argv)
    command = lambda folder: shlex.join(  # noqa: E731
        ["python", sys.argv[0] if argv is None else "study.py",
         *[folder if w == args.out else w for w in words]])
    tag = "-".join(["figure2"] * args.figure2 + ["quick" if args.quick else "full"])
    other = f"{args.out.rstrip(os.sep)}-{tag}"
    made = study_settings(args.quick, variants, seeds, steps, held_out, extra)
    keep_settings(args.out, made, False, command(other))  # refused before anything is made
    os.makedirs(args.out, exist_ok=True)
    if not args.report:
        keep_settings(args.out, made, True, command(other))
        again = command(args.out)
        train_all(args.out, variants, seeds, steps, budget, extra, held_out, again)
    names = [n for n in variants
             if all(finished(run_dir(args.out, n, s), steps) for s in seeds)]
    if not names:
        sys.exit(f"study: no variant has all {len(seeds)} seeds finished in {args.out}")
    minutes = sum(run_minutes(run_dir(args.out, n, s)) for n in names for s in seeds)
    print(write_figure2_report(args.out, names, seeds, steps, minutes, args.quick)
          if args.figure2 else write_report(args.out, names, seeds, steps, minutes,
                                            [n for n in variants if n not in names], args.quick))
    if args.assets:
        os.makedirs(args.assets, exist_ok=True)
        for name in written[1:]:  # what was written, not a file put there since
            copy_written(os.path.join(args.out, name), os.path.join(args.assets, name))
    print(f"wrote {', '.join(os.path.join(args.out, w) for w in written)}" +
          (f"; copied all but {written[0]} to {args.assets}" if args.assets else ""))


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as err:  # one line, no traceback
        sys.exit(printable(f"study: error: {err}"))
    except SystemExit as err:  # its own and runs.py's lines quote paths
        sys.exit(printable(err.code) if isinstance(err.code, str) else err.code)
