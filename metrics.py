"""
metrics.py: what a run reports: the step and eval lines, metrics.jsonl's fields, the loss's
diagnostics (mismatch, drift by lag, forgetting) and the alarms that watch them. Start at
step_metrics.
"""
import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from evals import per_domain
from loss import LOSSES, clip_eps
import ranks
from runs import truncate_metrics, write_file


def print0(*args, **kw):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kw)


@dataclass
class Record:
    """What the loop keeps between steps."""
    args: object
    log: object
    world: int
    n_params: int
    domains: list
    compute_s: float = 0.0  # device-seconds: wall-clock x processes
    flops: float = 0.0
    evals: list = field(default_factory=list)
    eval_intr: list = field(default_factory=list)
    warned: set = field(default_factory=set)
    empty_steps: int = 0  # steps in a row that kept no prompt
    forgets: list = field(default_factory=list)
    saved: int = -1
    evaluated: int = -1
    loop_start: tuple = (0.0, 0)


def new_record(env, trainer):
    """A new run's record, or a resumed one's."""
    args, state = env.args, env.state
    rec = Record(args, env.log, env.ctx.world if env.ctx else 1, trainer.n_params,
                 sorted({p.get("domain", "math") for p in env.train}),
                 state.get("compute_s", 0.0), state.get("flops", 0.0),
                 loop_start=(time.time(), trainer.version))
    rec.empty_steps = state.get("empty_steps", 0)
    path = os.path.join(args.out, "metrics.jsonl")
    if env.rank0 and env.ckpt:
        kept = truncate_metrics(path, trainer.version)
        rec.evals = [(r["compute_s"], r["pass_rate"]) for r in kept if r["kind"] == "eval"]
        rec.evaluated = max((r["step"] for r in kept if r["kind"] == "eval"), default=-1)
        rec.eval_intr = [r.get("intr", 0.0) for r in kept if r["kind"] == "eval"]
        rec.forgets = [r["forget"] for r in kept if r["kind"] == "train" and r["kept_prompts"]
                       and r.get("forget") is not None][-FORGET_WINDOW:]  # the alarm's window
        print(f"resumed from {env.ckpt} at step {trainer.version}")
    elif env.rank0:
        ran = "one process, synchronous" if rec.world == 1 else args.mode  # what actually ran
        write_file(path, json.dumps({"kind": "config", **vars(args), "ran": ran,
                                     "n_params": rec.n_params, "world": rec.world}) + "\n")
    return rec


def step_metrics(rec, trainer, batch, groups, rstats, train, loss_value, stats, dt):
    """The step's metrics summed over the trainers (a collective)."""
    step, samples, rows = trainer.version - 1, batch.samples, batch.rows  # the version trained
    lags = [step - v for r in rows for v, m in zip(samples[r].versions, samples[r].mask) if m]
    sums, maxes = ranks.all_reduce_stats(trainer.ctx, {
        "groups": len(groups), "kept": len(set(batch.group[rows].tolist())), "n": len(samples),
        "reward": batch.rewards.sum().item(), "correct": sum(batch.correct),
        "len": sum(len(s.tokens) for s in samples),
        "trunc": sum(batch.truncated.tolist()), "intr": sum(0 in s.mask for s in samples),
        "excluded": int((batch.truncated & ~batch.valid).sum()),
        "nll": -sum(lp for s in samples for lp, m in zip(s.logps, s.mask) if m),
        "sampled": sum(sum(s.mask) for s in samples),
        "lag": sum(lags), "lag_n": len(lags), "too_old": rstats["too_old"],
        "gen_tokens": rstats["gen_tokens"],
        "train_tokens": sum(len(batch.prompt_ids[r]) + len(samples[r].tokens) for r in rows),
        "loss": loss_value,
        **{f"{key}/{d}": sum(c if key == "correct" else 1 for g in groups
                             if train[g["index"]].get("domain", "math") == d
                             for c in g["correct"])
           for d in rec.domains for key in ("correct", "n")}},
        {"lag_max": max(lags, default=0)})
    rec.flops += 2 * rec.n_params * sums["gen_tokens"] + 6 * rec.n_params * sums["train_tokens"]
    n = sums["n"]
    m = {"kind": "train", "step": trainer.version, "compute_s": rec.compute_s, "flops": rec.flops,
         "reward": sums["reward"] / n, "pass_rate": sums["correct"] / n, "len": sums["len"] / n,
         "trunc": sums["trunc"] / n, "intr": sums["intr"] / n,
         "excluded_truncated": int(sums["excluded"]),
         # mean -log p: estimates it
         "entropy": sums["nll"] / max(sums["sampled"], 1),
         "lag": sums["lag"] / max(sums["lag_n"], 1), "lag_max": maxes.get("lag_max", 0),
         "prompts": int(sums["groups"]),
         "kept_prompts": int(sums["kept"]), "dropped_zero_var": int(sums["groups"] - sums["kept"]),
         "too_old": int(sums["too_old"]), "skipped_bad": stats["skipped_bad"],
         "loss": sums["loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"],
         "dt_ms": dt * 1000,
         "tok_s": tokens_per_s(sums, rstats, dt),
         **{k: v for k, v in stats.items() if k not in ("grad_norm", "skipped_bad", "lr")}}
    if len(rec.domains) > 1:
        m.update({f"pass_rate/{d}": sums[f"correct/{d}"] / max(sums[f"n/{d}"], 1)
                  for d in rec.domains})
    return m


def tokens_per_s(sums, rstats, dt):
    """tok/s: the sampler's in one process, the trainers' under torchrun."""
    if "gen_s" in rstats:
        return sums["len"] / rstats["gen_s"]
    return sums["train_tokens"] / dt if sums["train_tokens"] else None


# -----------------------------------------------------------------------------
# the loss's diagnostics: per micro-batch, then summed into the step's metrics


def micro_stats(logp, gen_logp, mask, lag, kind, eps_high):
    """A micro-batch's mismatch, drift by lag and forgetting."""
    return (ratio_stats(logp, gen_logp, mask, kind, eps_high),
            drift_by_lag(logp, gen_logp, mask, lag), forgetting(logp, gen_logp, mask))


def step_stats(parts):
    stats, drift, lost = zip(*parts)
    mismatch = {f"mismatch_{k}": float(np.mean([s[k] for s in stats])) for k in stats[0]}
    lost_sum, sure = (sum(x) for x in zip(*lost))
    return {**mismatch, **lag_drift(drift), "forget": float(lost_sum / max(int(sure), 1))}


def lag_drift(parts):
    """drift_by_lag per micro-batch -> mean |log rho| by lag, and the oldest lag's (drift)."""
    size = max(len(sums) for sums, _ in parts)
    sums = sum(torch.nn.functional.pad(s, (0, size - len(s))) for s, _ in parts)
    counts = sum(torch.nn.functional.pad(n, (0, size - len(n))) for _, n in parts)
    by_lag = [float(s / n) if n else None for s, n in zip(sums.tolist(), counts.tolist())]
    return {"log_rho_by_lag": by_lag,
            "drift": next((v for v in reversed(by_lag) if v is not None), 0.0)}


@torch.no_grad()
def ratio_stats(logp, gen_logp, mask, kind="cispo", eps_high=None):
    """Mean and max |log rho|, and the share of tokens capped or clipped."""
    diff = (logp - gen_logp)[mask.bool()]  # (K,)
    if diff.numel() == 0:
        return {"abs_diff_mean": 0.0, "abs_diff_max": 0.0, "frac_above_cap": 0.0}
    cap = LOSSES[kind][2](clip_eps(kind, None, eps_high)[1])
    return {
        "abs_diff_mean": diff.abs().mean().item(),
        "abs_diff_max": diff.abs().max().item(),
        "frac_above_cap": (diff > math.log(cap)).float().mean().item(),
    }


@torch.no_grad()
def drift_by_lag(logp, gen_logp, mask, lag):
    """Sum and count of |log rho| per policy-version lag."""
    keep = mask.bool()
    lag = lag[keep]
    diff = (logp - gen_logp)[keep].abs().double()
    size = int(lag.max()) + 1 if lag.numel() else 1
    return torch.bincount(lag, weights=diff, minlength=size), torch.bincount(lag, minlength=size)


@torch.no_grad()
def forgetting(logp, gen_logp, mask, sure=0.9):
    """Sum and count of max(0, log p_gen - log p_train) over tokens sampled with p >= sure."""
    keep = mask.bool() & (gen_logp >= math.log(sure))
    return (gen_logp - logp)[keep].clamp(min=0).double().sum(), keep.sum()


def log_line(m, steps):
    line = (f"step {m['step']}/{steps} | reward {m['reward']:+.3f} | pass@1 {m['pass_rate']:.3f} | "
            f"len {m['len']:.1f} | ent {m['entropy']:.3f} | trunc {m['trunc']:.3f} | "
            f"intr {m['intr']:.3f} | "
            f"lag {m['lag']:.1f}/{m['lag_max']:.0f} | drift {m.get('drift', 0.0):.3f} | "
            f"forget {m.get('forget', 0.0):.3f} | "
            f"kept {m['kept_prompts']}/{m['prompts']} | loss {m['loss']:+.4f} | "
            f"dt {m['dt_ms']:.0f} ms | tok/s "
            f"{'n/a' if m['tok_s'] is None else format(m['tok_s'], '.0f')}")
    if "generate_ms" in m:
        line += (f" | gen {m['generate_ms']:.0f} verify {m['verify_ms']:.0f} "
                 f"train {m['train_ms']:.0f} ms")
    if "train_peak_gb" in m:
        line += (" | peak" + (f" gen {m['gen_peak_gb']:.1f}" if "gen_peak_gb" in m else "") +
                 f" train {m['train_peak_gb']:.1f} GB")
    if "gen_busy" in m:
        line += (f" | busy gen {m['gen_busy']:.2f} train {m['train_busy']:.2f} "
                 f"| sync {m['sync_ms']:.0f} ms")
    return line


def progress(rec, step):
    """The step line's end: the last held-out pass rate, the ETA."""
    t0, step0 = rec.loop_start
    left = (time.time() - t0) / max(step - step0, 1) * (rec.args.steps - step)
    held_out = f" | held-out {rec.evals[-1][1]:.3f}" if rec.evals else ""
    return f"{held_out} | ETA {int(left // 60)}m{int(left % 60):02d}s"


def log_step(rec, m):
    rec.log(m)
    if m["step"] % rec.args.log_every == 0 or m["step"] == rec.args.steps:
        print0(log_line(m, rec.args.steps) + progress(rec, m["step"]), flush=True)


def log_eval(rec, step, result, stamp):
    """An eval's live fit, line and alarms."""
    from fit import predict_final  # scipy loads on rank 0 only
    args, (compute_s, flops) = rec.args, stamp
    m = {"kind": "eval", "step": step, "compute_s": compute_s, "flops": flops, **result}
    rec.evals.append((compute_s, result["pass_rate"]))
    rec.eval_intr.append(result["intr"])
    C, R = np.array(rec.evals).T
    try:  # the live fit must not stop the run
        pred = predict_final(C, R, C_end=compute_s / max(step, 1) * args.steps)
    except ValueError as err:
        pred = None
        print(f"eval step {step}: no live fit ({err})")
    if pred:
        m.update(fit_A=pred["A"], fit_B=pred["B"], fit_C_mid=pred["C_mid"],
                 predicted_final=pred["R_end"])
    rec.log(m)
    fit_txt = (f" | fit A {pred['A']:.3f} B {pred['B']:.2f} C_mid {pred['C_mid']:.0f} device-s "
               f"-> predicted {pred['R_end']:.3f} at step {args.steps}") if pred else ""
    print(f"eval step {step} | held-out pass rate {result['pass_rate']:.3f} "
          f"+- {result['pass_rate_se']:.3f} (mean@{args.eval_samples}, n={result['n']})"
          f"{per_domain(result)} | trunc {result['trunc']:.3f} | intr {result['intr']:.3f}"
          f"{fit_txt}", flush=True)
    eval_alarms(rec, step, result)


# alarm thresholds
FORGET_ALARM, FORGET_WINDOW = 0.01, 5
HELD_OUT_TRUNC_ALARM = 0.05
HELD_OUT_DROP_ALARM = 0.1
HELD_OUT_INTR_RISE = 0.05
SEE = " (see docs/reference.md, alarms)"


def warn_once(rec, key, step, text):
    """One warning per kind of alarm in a run."""
    if key not in rec.warned:
        print0(f"warning: step {step}: {text}", flush=True)
    rec.warned.add(key)


def alarms(rec, m):
    """Warn once per kind -> why the run stops (--max_empty_steps), else None."""
    args, step = rec.args, m["step"]
    if m["trunc"] > 0.10:
        warn_once(rec, "trunc", step, f"{m['trunc']:.0%} of the batch was truncated (no eos "
                  "within the budgets): " + ("--keep_truncated keeps them in the loss, as wrong "
                  "answers" if args.keep_truncated else "they get no gradient") +
                  "; watch trunc and forget" + SEE)
    if m["kept_prompts"] and m.get("forget") is not None:
        rec.forgets = (rec.forgets + [m["forget"]])[-FORGET_WINDOW:]
    forget = sum(rec.forgets) / FORGET_WINDOW  # a window not full counts its gaps as 0
    if forget > FORGET_ALARM:
        warn_once(rec, "forget", step, f"forget {forget:.3f} (mean of the last {FORGET_WINDOW} "
                  "steps): the policy lost log-prob on tokens its sampler was sure of "
                  f"{m['lag_max']:.0f} versions ago, a collapse may follow: a lower --max_lag, "
                  f"--mode sync, or --neg_trust above {rec.args.neg_trust:g}" + SEE)
    rec.empty_steps = rec.empty_steps + 1 if m["kept_prompts"] == 0 else 0
    if rec.empty_steps and m["pass_rate"] < 1.0:  # every sample right: solved, not an alarm
        warn_once(rec, "empty", step, f"no prompt kept (trunc {m['trunc']:.2f}, pass@1 "
                  f"{m['pass_rate']:.2f}): no optimizer step; the run stops after "
                  f"{args.max_empty_steps} such steps in a row" + SEE)
    if rec.empty_steps < args.max_empty_steps:
        return None
    if m["trunc"] >= 0.5:
        cause = ("the samples run out of budget and truncated samples get no gradient. "
                 "Raise --answer_budget, " + ("" if args.keep_truncated else
                                                  "or train on them with --keep_truncated, ") +
                 "or lower --lr / --max_lag")
    elif m["pass_rate"] >= 0.5:
        cause = ("every group was all correct: the policy has solved these prompts "
                 "(harder data, or stop here)")
    else:
        cause = ("every group was all wrong: the prompts are too hard for this policy "
                 "(easier data, more --samples)")
    return (f"stopping at step {step}: {rec.empty_steps} steps in a row kept no prompt "
            f"(--max_empty_steps {args.max_empty_steps}): {cause}")


def eval_alarms(rec, step, result):
    """The held-out eval's alarms."""
    older = rec.world > 1 and rec.args.mode != "sync"  # off-policy: batches behind the policy
    if result["trunc"] > HELD_OUT_TRUNC_ALARM:
        who = ("the base model writes past its budgets. Raise --answer_budget or --think_budget"
               if step == 0 else "the policy being trained writes past its budgets" + (
                   " (its training batches are older). Raise --answer_budget, or train nearer "
                   "on-policy: a lower --max_lag, or --mode sync" if older else
                   ". Raise --answer_budget or lower --lr"))
        keep = ("" if rec.args.keep_truncated else
                ", or train on truncated samples with --keep_truncated")
        warn_once(rec, "held-out trunc", step, f"{result['trunc']:.1%} of the held-out samples ran "
                  f"out of budget: {who}{keep}{SEE}")
    if len(rec.evals) > 1 and rec.evals[-2][1] - rec.evals[-1][1] > HELD_OUT_DROP_ALARM:
        warn_once(rec, "held-out drop", step, f"the held-out pass rate fell from "
                  f"{rec.evals[-2][1]:.3f} to {rec.evals[-1][1]:.3f} since the last eval: " + (
                      "under PipelineRL-k, the stale samples': a lower --max_lag, or --mode sync"
                      if older else "on-policy: a lower --lr") + SEE)
    if len(rec.eval_intr) > 1 and rec.eval_intr[-1] - rec.eval_intr[-2] > HELD_OUT_INTR_RISE:
        warn_once(rec, "held-out intr", step, f"{rec.eval_intr[-1]:.1%} of the held-out samples "
                  f"were interrupted ({rec.eval_intr[-2]:.1%} at the eval before): the policy "
                  "thinks past --think_budget, and all-wrong groups give no gradient back: "
                  "--mode sync" + SEE)
