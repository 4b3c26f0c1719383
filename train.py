"""
train.py: the ScaleRL training loop (arXiv 2510.13786). Start at `main`: each step
`source.get` gives verified groups (pipeline.py), `make_batch` keeps the samples that train and
computes advantages (loss.py), `train_step` takes the CISPO loss (`loss.policy_loss`) and an AdamW
step, and `source.publish` sends the weights to the sampler. One process, torchrun and FSDP2 differ
only in the rollout source and the trainer (trainer.py), chosen at start-up. Every ScaleRL choice is
a flag (config.py); sizes come from config.RECIPES.

    python train.py                            # the embedded toy task and model, on a CPU
    python train.py --loss dapo --no-fp32_head # an ablation: one flag per ScaleRL choice
    torchrun_local --nproc_per_node 8 train.py --model DIR --data FILE --gen_ranks 6 --fsdp
"""

import config

if __name__ == "__main__":  # flags, --help and their errors before torch's seconds of imports
    config.parse_first(config.make_parser())

import glob
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from checks import (check_code_rewards, check_optimizer_state, check_resumed_state, check_supported,
                    checked_prompt_ids, model_config, weight_elements)
import evals
from data import (format_prompt, load_source_problems, prompts_ids, special_tokens,
                  split_problems)
import faults
from hub import hide_progress_bars
import pipeline
import plan
import ranks
from loss import LengthControl, make_batch, policy_loss, row_weights
from metrics import (alarms, log_eval, log_step, micro_stats, new_record, print0, step_metrics,
                     step_stats)
from runs import (checkpoint_tmp, checkpoints, metrics_log, prepare_out_dir, read_jsonl,
                  release_lock, resume_command, resume_point, save_checkpoint, step_of)
from toy import PRESETS, toy_model_dir, toy_task
from trainer import ShardedTrainer, Trainer, collate, kernels_line, pack

# -----------------------------------------------------------------------------
# data, model, evals


def load_data(args):
    problems = [p for path in (args.data or "toy").split(",")
                for p in load_source("--data", path, args.seed)]
    if args.val_data:
        val = load_source("--val_data", args.val_data, args.seed)
        if (args.val_size or 0) > len(val):
            sys.exit(f"error: --val_size {args.val_size}: --val_data {args.val_data} has "
                     f"{len(val)} problems: give at most {len(val)}, or no --val_size for all")
        return problems, val[:args.val_size]
    if args.val_size is None:
        return split_problems(problems, min(200, max(1, len(problems) // 10)), args.seed)
    if args.val_size >= len(problems):
        sys.exit(f"error: --val_size {args.val_size}: --data has {len(problems)} problems, and "
                 "some must be left to train on: give a smaller --val_size "
                 f"(e.g. {max(1, len(problems) // 10)}), or a --val_data file")
    return split_problems(problems, args.val_size, args.seed)


def load_source(flag, path, seed):
    """One --data / --val_data source's problems; a bad one exits with one line."""
    if path in PRESETS:
        return [dict(p) for p in toy_task(seed, path)]
    try:
        return load_source_problems(path, "test" if flag == "--val_data" else "train")
    except OSError as err:
        sys.exit(f"error: {flag} {path}: {err.strerror or err}")
    except ValueError as err:
        sys.exit(f"error: {flag}: {err}")


def note_toy_model(args, paths, flag, verb):
    """A real dataset without --model: the toy model does not know it."""
    sources = (paths or "toy").split(",")
    others = [p for p in sources if p not in PRESETS]
    if not others or args.model:
        return
    known = [p for p in sources if p in PRESETS]
    knows = (f"knows the {' and '.join(known)} task but not {', '.join(others)}: expect a pass "
             "rate near 0 on that part" if known else
             "only knows the toy arithmetic task: expect a pass rate near 0")
    print(f"note: {flag} without --model {verb} the embedded toy model, which {knows}; give "
          "--model a real checkpoint", flush=True)


def base_model_dir(args):
    return toy_model_dir(preset=args.data if args.data in PRESETS else "toy")


def say_threads(args):
    """One process on a CPU: faults.pick_threads, and the line that says its count."""
    if pick_device(args).type == "cpu":
        print(f"torch threads: {faults.pick_threads()} of {os.cpu_count()} cores", flush=True)


def pick_device(args, ctx=None):
    if ctx:
        return torch.device(ctx.device)
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def load_model(model_dir, args, device):
    """-> (tokenizer, model in --dtype on device), its config and weight files checked before any
    layer is built; no folder's code runs."""
    dtype = getattr(torch, args.dtype)
    try:
        cfg = model_config(model_dir)
        if (why := plan.weights_problem(cfg, *weight_elements(model_dir), dtype, device)):
            raise ValueError(why)
        weights = sum(os.path.getsize(f) for f in
                      glob.glob(os.path.join(model_dir, "*.safetensors")) +
                      glob.glob(os.path.join(model_dir, "*.bin")))
        if weights > 1e8:
            print0(f"loading {model_dir} ({weights / 1e9:.1f} GB of weights) onto {device} ...",
                   flush=True)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        for domain in ("math", "code"):
            format_prompt(tokenizer, "", domain)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, config=cfg, dtype=dtype, trust_remote_code=False).to(device)
        check_supported(model)
    except ValueError as err:
        sys.exit(f"error: --model {model_dir}: {' '.join(str(err).split())[:400]}")
    except BaseException as err:  # a Rust panic is no Exception
        if type(err).__name__ != "PanicException":
            raise
        sys.exit(f"error: --model {model_dir}: its tokenizer fails: "
                 f"{' '.join(str(err).split())[:400]}")
    return tokenizer, model


def tokenize_prompts(tokenizer, problems):
    return prompts_ids(tokenizer, [p["prompt"] for p in problems],
                       [p.get("domain") for p in problems])


def evaluate(model, tokenizer, val_ids, val, args, most=None):
    """evals.evaluate with the run's sampler: one sequence per sample at most (or `most`)."""
    n = len(val_ids) * args.eval_samples
    steps = pipeline.make_sampler(model, tokenizer, args, max(map(len, val_ids)),
                                  most=min(n, most or n))
    return evals.evaluate(steps, tokenizer, val_ids, val, args.eval_samples, args.unsafe_code_exec)


def say_kernels(model, args):
    """The kernels in force (a fallback shows); on CUDA none for decode attention: a user error."""
    p = next(model.parameters())
    try:
        print0(kernels_line(model.config, p.device, p.dtype, args.fp32_head), flush=True)
    except RuntimeError as err:  # no paged decode attention on this CUDA torch: what to install
        sys.exit(f"error: {err}")


def eval_only(args):
    """--eval_only: the held-out mean@k of --model, printed."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.exit("error: --eval_only runs as one process: python train.py --eval_only ..., "
                 "not under torchrun")
    _, val = load_data(args)
    check_code_rewards(args, val)
    note_toy_model(args, args.val_data, "--val_data", "evaluates")
    hide_progress_bars()
    say_threads(args)
    model_dir = args.model_dir or base_model_dir(args)
    tokenizer, model = load_model(model_dir, args, pick_device(args))
    val_ids = checked_prompt_ids(args, tokenizer, model, val)
    say_kernels(model, args)
    plan.print_memory_plan(model.config, args, None, next(model.parameters()).device,
                               max(map(len, val_ids)),
                               len(special_tokens(tokenizer)["interrupt_ids"]),
                               evaluate=len(val) * args.eval_samples)
    t0 = time.time()
    r = evaluate(model.eval(), tokenizer, val_ids, val, args)
    held = args.val_data or f"{len(val)} held-out problems of " + \
        (f"--data {args.data}" if args.data else "the toy task")
    print(evals.eval_only_line(r, f"eval {args.model or model_dir} on {held}", args.eval_samples,
                               len(val), time.time() - t0), flush=True)
    return r

# -----------------------------------------------------------------------------
# the step


def train_step(trainer, batch, args):
    """ScaleRL's step on this trainer's rows (make_batch chose them): the loss over micro-batches,
    backward, the gradient sum, clip, AdamW. -> (loss, stats)."""
    lr = trainer.opt.param_groups[0]["lr"]  # the rate this step trains with
    if not batch.sums["sample"]:  # no trainer kept a sample
        trainer.version += 1
        return 0.0, {"grad_norm": 0.0, "skipped_bad": trainer.bad_steps > 0, "lr": lr}
    model, rows = trainer.model.train(), batch.rows
    plan.peak_gb(model)
    device = next(model.parameters()).device
    adv = batch.adv.to(device)
    tokens = torch.tensor([sum(batch.samples[r].mask) for r in rows])
    group = batch.group[rows]
    # each row's weight in the whole batch's loss (--agg, prompt average: section 3.2), so that
    # micro-batches and trainers sum to the one loss of the whole batch, however its rows split
    weights = row_weights(group, tokens, args.agg, batch.sums, args.loss).to(device)
    loss_sum, stats = 0.0, []
    for part in trainer.micro_batches(batch):
        prompts = [batch.prompt_ids[rows[i]] for i in part]
        samples = [batch.samples[rows[i]] for i in part]
        _, _, mask, gen_logp, lag = collate(prompts, samples, 0, device, trainer.version)
        logp = trainer.logprobs(*pack(prompts, samples, device))
        at = torch.tensor(part, device=device)
        # CISPO by default (section 4): sg(min(rho, 4)) A log p, rho against the sampler's log-probs
        loss = policy_loss(logp, gen_logp, adv[at], mask, group[part], kind=args.loss,
                           agg=args.agg, eps_low=args.eps_low, eps_high=args.eps_high,
                           weights=weights[at], neg_trust=args.neg_trust or None)
        loss.backward()
        trainer.accumulate()
        loss_sum += loss.item()
        stats.append(micro_stats(logp.detach(), gen_logp, mask, lag, args.loss, args.eps_high))
    trainer.reduce_grads()  # summed over the trainers
    norm = trainer.clip_grads()
    if math.isfinite(norm) and math.isfinite(loss_sum):  # every trainer sees the same sums
        trainer.opt.step()
        trainer.sched.step()
        trainer.bad_steps = 0
        trainer.copy_master()
    else:
        trainer.skip_step(loss_sum, norm)
    trainer.zero_grad()
    trainer.version += 1
    peak = plan.peak_gb(model)
    return loss_sum, {**(step_stats(stats) if stats else {}), "grad_norm": norm,
                      "skipped_bad": trainer.bad_steps > 0, "lr": lr,
                      **({"train_peak_gb": peak} if peak else {})}


# -----------------------------------------------------------------------------
# evals and checkpoints


def run_eval(rec, model, env, step, stamp):
    result = evaluate(model.eval(), env.tokenizer, env.val_ids, env.val, env.args,
                        pipeline.sampler_most(env.args, env.ctx))
    if result is not None:
        log_eval(rec, step, result, stamp)


def log_evals(rec, env, source, wait=False):
    """Log the generators' finished evals."""
    for step, records, stamp in source.evals_done(wait):
        log_eval(rec, step, evals.summarize_eval(records, env.val, env.args.eval_samples), stamp)


def held_out_eval(rec, env, trainer, source):
    """A held-out eval of the trainer's version (by the generators, or here)."""
    step, stamp = trainer.version, (rec.compute_s, rec.flops)
    source.held_out(step, trainer, lambda model: run_eval(rec, model, env, step, stamp), stamp)
    rec.evaluated = step


def save(rec, env, trainer, source):
    model, state = trainer.whole_model(), trainer.state_dict()
    state.update(source.state_dict(trainer.version), compute_s=rec.compute_s, flops=rec.flops,
                 empty_steps=rec.empty_steps, args=vars(env.args))
    trainer.save_shards(checkpoint_tmp(env.args.out, trainer.version, fresh=env.rank0))
    if env.rank0:
        path = save_checkpoint(env.args.out, trainer.version, model, env.tokenizer, state,
                               env.args.keep, fresh=False)
        print(f"saved {path}", flush=True)
    rec.saved = trainer.version

# -----------------------------------------------------------------------------
# start-up


@dataclass
class Setup:
    args: object
    ctx: object  # ranks.Context; None for one process
    rank0: bool
    log: object
    train: list
    val: list
    train_ids: list
    val_ids: list
    tokenizer: object
    model: object
    model_dir: str
    ckpt: str  # None for a new run
    state: dict


def start(args):
    """Every rank's set-up: user errors before anything is made in --out."""
    hide_progress_bars()
    ranks.check_launcher()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    ctx = ranks.setup(args)  # the ranks meet first: one that fails from here on stops them all
    train, val = load_data(args)
    check_code_rewards(args, train + val)
    ckpt, state = None, {}
    if rank0:  # rank 0 alone judges --out and what to resume; ranks.share_run gives the others its word
        prepare_out_dir(args)
        ckpt, state = resume_point(args, quiet=False)
    log = metrics_log(args, rank0)  # checks --wandb/--tensorboard before ranks wait
    note_toy_model(args, args.data, "--data", "trains")
    if ckpt:  # every value, and the flags against these, before any rank waits
        check_resumed_state(state, os.path.join(ckpt, "state.pt"), step_of(ckpt), args, len(train))
    ckpt, state = ranks.share_run(ctx, args, ckpt, state)
    if ctx is None:
        say_threads(args)
    torch.manual_seed(args.seed)
    model_dir = ckpt or args.model_dir or base_model_dir(args)
    tokenizer, model = load_model(model_dir, args, pick_device(args, ctx))
    if ckpt:  # every rank, before they meet
        check_optimizer_state(state, os.path.join(ckpt, "state.pt"), model)
    ids = checked_prompt_ids(args, tokenizer, model, train + val)
    train_ids, val_ids = ids[:len(train)], ids[len(train):]
    if ctx:  # a packed rollout row's tokens per sample
        ranks.meet(ctx, state.get("step", 0),
                   max(map(len, train_ids)) + args.think_budget + args.answer_budget +
                   len(special_tokens(tokenizer)["interrupt_ids"]),
                   pipeline.weight_layout(model, args.bucket_mb))
    return Setup(args, ctx, rank0, log, train, val, train_ids, val_ids, tokenizer, model,
                 model_dir, ckpt, state)


def rollout_source(env):
    """Groups sampled here (LocalRollouts), or by generator ranks (RemoteRollouts)."""
    if env.ctx is None:
        return pipeline.LocalRollouts(env.args, env.model, env.tokenizer, env.train, env.train_ids,
                                      env.state.get("step", 0), env.state.get("curriculum"))
    return pipeline.RemoteRollouts(env.ctx, env.args)


def make_trainer(env):
    sharded = env.args.fsdp and env.ctx is not None
    return (ShardedTrainer if sharded else Trainer)(env.args, env.model, env.ctx, env.state,
                                                    env.ckpt, env.tokenizer.pad_token_id or 0)


def describe(env, trainer):
    """Rank 0's start-up lines."""
    args, ctx = env.args, env.ctx
    for line in config.recipe_lines(args, len(env.val)):
        print0(line)
    roles = (f"{ctx.n_trainers} trainer + {ctx.n_gens} generator ranks, {args.mode}, "
             f"max lag {ctx.k}" if ctx else "one process, synchronous and on-policy")
    device = next(env.model.parameters()).device
    print0(f"model {env.model_dir} ({trainer.n_params / 1e6:.2f}M params, "
           f"{env.model.config.model_type}) on {device} | {roles} | {len(env.train)} train / "
           f"{len(env.val)} held-out problems")
    say_kernels(env.model, args)
    if env.rank0:
        plan.print_memory_plan(env.model.config, args, env.ctx, device,
                                   max(map(len, env.train_ids + env.val_ids)),
                                   len(special_tokens(env.tokenizer)["interrupt_ids"]))

# -----------------------------------------------------------------------------
# the training loop


def main(args):
    """The training loop: one process, or a trainer rank under torchrun. -> None; --eval_only: its
    dict."""
    if args.eval_only:
        return eval_only(args)
    t_start = time.time()
    env = start(args)
    trainer, source = make_trainer(env), rollout_source(env)
    rec = new_record(env, trainer)
    describe(env, trainer)
    rec.saved = trainer.version if env.ckpt else -1  # a signal during step 0's eval saves step 0
    # the base model's pass rate (the compute curve's first point), or a resumed step's eval that a
    # signal cut short (rank 0 read the metrics)
    if trainer.any_rank(env.rank0 and rec.evaluated != trainer.version
                        and evals.due(trainer.version, args)):
        held_out_eval(rec, env, trainer, source)
    rec.evaluated = trainer.version
    length = LengthControl.from_args(args)  # the length penalty, if any, in make_batch's rewards
    stopped, signaled = None, False
    while trainer.version < args.steps:
        # SIGINT / SIGTERM to any rank: save, then stop (every trainer agrees, or one waits alone)
        if trainer.any_rank(source.stop_requested()):
            signaled = True
            break
        # ---- rollouts: batch `version`'s groups, sampled by weights at most k versions older
        # (PipelineRL-k, section 3.1; one process: on-policy), already verified
        t0 = time.time()
        groups, rstats = source.get(trainer.version)
        if groups is None:  # a signal stopped the sampling
            signaled = True
            break
        # No-Positive-Resampling (section 3.2) may retire every prompt: a short batch ends the run
        if trainer.any_rank(len(groups) < source.share):
            stopped = (f"stopping at step {trainer.version}: out of prompts "
                       "(No-Positive-Resampling retired every one)")
            print0(stopped, flush=True)
            break
        # ---- the batch, one step, the new weights out. The batch is loss.py's recipe: truncated
        # samples out (A.15), zero-variance groups out, batch-normalized advantages (section 3.2)
        batch = make_batch(groups, length=length, keep_truncated=args.keep_truncated,
                           zero_var_filter=args.zero_var_filter, adv_norm=args.adv_norm,
                           all_sum=trainer.ranks_sum)
        t_train = time.time()
        loss, stats = train_step(trainer, batch, args)
        t_train = time.time() - t_train
        eval_now = evals.due(trainer.version, args)
        # the eval is asked for with the weights it must use: generators evaluate exactly this step
        sync_s, sync_bytes = source.publish(trainer, trainer.version == args.steps, eval_now)
        # ---- accounting, logging, alarms
        dt = time.time() - t0
        # the fit's compute axis (Eq. 1's C): every device's seconds but the held-out evals'
        rec.compute_s += (dt - source.uncounted()) * rec.world
        m = step_metrics(rec, trainer, batch, groups, rstats, env.train, loss, stats, dt)
        log_step(rec, m | source.busy(dt, rstats, t_train, sync_s, sync_bytes))
        log_evals(rec, env, source)
        stop = alarms(rec, m)
        # ---- checkpoint, then eval (a failing eval loses no step)
        if (args.save_every and trainer.version % args.save_every == 0) or \
                trainer.version == args.steps:
            save(rec, env, trainer, source)
        if eval_now:
            held_out_eval(rec, env, trainer, source)
        if stop:
            print0(stop, flush=True)
            stopped = stop
            break
    finish(rec, env, trainer, source, stopped, signaled, t_start)


def finish(rec, env, trainer, source, stopped, signaled, t_start):
    """The end: save, evaluate unless a signal stopped the run."""
    if stopped:
        rec.log({"kind": "stopped", "step": trainer.version, "reason": stopped})
    if trainer.version != rec.saved:
        save(rec, env, trainer, source)
    if trainer.version != rec.evaluated and not signaled:
        held_out_eval(rec, env, trainer, source)
    log_evals(rec, env, source, wait=not signaled)
    source.close(trainer.version)
    if signaled:
        saved = checkpoints(env.args.out)[-1:] or ["nothing (no step finished yet)"]
        print0(f"stopped by a signal after step {trainer.version}/{env.args.steps}; saved "
               f"{saved[0]}; continue with: {resume_command()}", flush=True)
    else:
        summary(env.args, time.time() - t_start)
    release_lock()  # --out is free again


def serve_rollouts(args):
    """A generator rank's life: pipeline.run_generator until the trainers say stop."""
    env = start(args)
    pipeline.run_generator(env.ctx, args, env.model, env.tokenizer, env.train, env.train_ids,
                           env.ckpt, env.state, env.val, env.val_ids)
    ranks.part(env.ctx)


def summary(args, seconds):
    """Rank 0: the run's end in a few lines."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    evals = [r for _, r in read_jsonl(metrics_path, follow=False) if r.get("kind") == "eval"]
    print(f"done in {seconds / 60:.1f} min | held-out pass rate {evals[0]['pass_rate']:.3f} -> "
          f"{evals[-1]['pass_rate']:.3f} (step {evals[0]['step']} -> {evals[-1]['step']})"
          if evals else f"done in {seconds / 60:.1f} min (no eval)")
    if evals and "fit_A" in evals[-1]:
        last = evals[-1]
        print(f"fit A {last['fit_A']:.3f} B {last['fit_B']:.2f} C_mid {last['fit_C_mid']:.3g} "
              f"device-s -> predicted {last['predicted_final']:.3f} at the end "
              f"(measured {last['pass_rate']:.3f})")
    print(f"metrics: {metrics_path} | checkpoints: {args.out}/ckpt-* | "
          f"next: python fit.py {args.out}", flush=True)


if __name__ == "__main__":
    args = config.get_args()
    if not args.eval_only:  # an eval has nothing to save
        faults.stop_on_signals()
    # under torchrun the last --gen_ranks ranks serve rollouts
    entry = serve_rollouts if ranks.generator_rank(args.gen_ranks) else main
    one = int(os.environ.get("WORLD_SIZE", "1")) == 1
    try:
        entry(args)
    except SystemExit as err:
        if isinstance(err.code, str):  # a user error: one line, exit 2
            message = err.code.removeprefix("error: ")
            faults.say_error(f"train.py: error: {message}")
            err.code = 2
        if one:
            raise
        sys.stdout.flush()
        os._exit(err.code or 0)
    except BaseException as err:
        if one:
            raise
        # one rank failing: exit without waiting
        traceback.print_exc()
        faults.report_failure(err)
        sys.stderr.flush()
        os._exit(1)
    if faults.STOP:  # the status a signal gives
        sys.exit(128 + signal.Signals[faults.STOP["name"]].value)
