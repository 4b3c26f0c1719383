"""
train.py: the ScaleRL training loop (SCALERL.md sections 2, 4 and 5), one process, synchronous.

Each step: take a batch of prompts from the curriculum, sample G completions per prompt with the
KV-cache sampler (generate.py, forced interruptions), verify the final answers (verify.py, reward +1 /
-1), drop prompts whose G rewards are all equal (zero-variance filtering), compute advantages and the
CISPO loss with prompt-level aggregation (loss.py) from the generator's recorded log-probs, take an
AdamW step (eps 1e-15, weight decay 0.01, linear warm-up then constant), update the pass-rate history
(No-Positive-Resampling). Every N steps: held-out pass rate (mean@k) and the live scaling-curve fit
(fit.py). Every ScaleRL choice is a flag whose default is ScaleRL's; the sizes default to the tiny CPU run.

Outputs in --out: metrics.jsonl (one JSON object per step and per eval; fit.py reads it), one log line
per step, checkpoints ckpt-STEP/ (a from_pretrained-able model folder + state.pt) and --resume.

Compute is counted as device-seconds of the training loop (wall-clock x devices; evaluation and
checkpointing are not counted) and as estimated FLOPs: 2 N per generated or prompt token plus
6 N per trained token, N = parameter count (attention FLOPs ignored).

    python train.py                                  # the embedded toy task and model, CPU, a few minutes
    python train.py --loss dapo --no-fp32_head       # an ablation: one flag per ScaleRL choice
    python train.py --model DIR --data ../shared/data/gsm8k_train.jsonl --val_data ../shared/data/gsm8k_test.jsonl \\
        --device cuda --dtype bfloat16 --prompts 48 --samples 16 --think_budget 12288 --answer_budget 2048 \\
        --lr 5e-7 --warmup 100 --eval_every 100 --eval_samples 16 --val_size 1000   # the paper's settings, one GPU
    python fit.py runs/toy                           # fit the sigmoid to the run's held-out curve
"""

import argparse
import glob
import json
import math
import os
import shutil
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from data import Curriculum, format_prompt, load_problems, split_problems, toy_model_dir, toy_problems
from fit import predict_final
from generate import INTERRUPT_PHRASE, check_supported, generate, sequence_logprobs
from loss import advantages, length_penalty, policy_loss, ratio_stats, zero_variance_keep
from verify import score_batch

# -----------------------------------------------------------------------------
# flags: defaults are ScaleRL's choices and the tiny CPU run's sizes (paper values in the help)


def get_args(argv=None):
    ap = argparse.ArgumentParser(description="ScaleRL training loop", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = ap.add_argument_group("model and data")
    g.add_argument("--model", default="", help="HF model folder (Llama/Qwen2/Qwen3); empty = the embedded toy model")
    g.add_argument("--data", default="", help="training jsonl, or several comma-separated; empty = the embedded toy task")
    g.add_argument("--val_data", default="", help="held-out jsonl; empty = hold out --val_size problems of --data")
    g.add_argument("--val_size", type=int, default=200, help="held-out problems (paper: 1000)")
    g.add_argument("--out", default="runs/toy", help="output folder: metrics.jsonl and checkpoints")
    g.add_argument("--device", default="auto", help="auto = cuda when available, else cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model weights dtype")
    g.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("rollouts")
    g.add_argument("--prompts", type=int, default=16, help="prompts per optimizer step (paper: 48)")
    g.add_argument("--samples", type=int, default=8, help="completions per prompt, G (paper: 16)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--slots", type=int, default=128, help="rows the sampler decodes at once (continuous batching)")
    g.add_argument("--think_budget", type=int, default=48, help="thinking tokens (paper: 12288)")
    g.add_argument("--answer_budget", type=int, default=16, help="answer tokens after </think> (paper: 2048)")
    g.add_argument("--length_control", default="interrupt", choices=["interrupt", "penalty", "none"],
                   help="interrupt = forced interruption (ScaleRL); penalty = length penalty on correct answers")
    g.add_argument("--l_max", type=int, default=0, help="length penalty L_max; 0 = think_budget + answer_budget")
    g.add_argument("--l_cache", type=int, default=0, help="length penalty L_cache; 0 = l_max // 7 (paper: 2k of 14k)")
    g = ap.add_argument_group("loss (loss.py)")
    g.add_argument("--loss", default="cispo", choices=["cispo", "dapo", "gspo", "grpo"])
    g.add_argument("--agg", default="prompt", choices=["prompt", "sample", "token"], help="loss aggregation")
    g.add_argument("--adv_norm", default="batch", choices=["batch", "prompt", "none"], help="advantage normalization")
    g.add_argument("--eps_low", type=float, default=None, help="None = the loss kind's default (SCALERL.md)")
    g.add_argument("--eps_high", type=float, default=None, help="None = the loss kind's default (cispo: cap 4)")
    g.add_argument("--fp32_head", action=argparse.BooleanOptionalAction, default=True, help="float32 LM head")
    g.add_argument("--zero_var_filter", action=argparse.BooleanOptionalAction, default=True,
                   help="drop prompts whose rewards are all equal")
    g.add_argument("--no_positive_resampling", action=argparse.BooleanOptionalAction, default=True,
                   help="never resample a prompt once its pass rate reaches 0.9")
    g = ap.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=150, help="optimizer steps")
    g.add_argument("--lr", type=float, default=3e-4, help="paper: 5e-7 for an 8B model")
    g.add_argument("--warmup", type=int, default=10, help="linear warm-up steps (paper: 100)")
    g.add_argument("--weight_decay", type=float, default=0.01)
    g.add_argument("--adam_eps", type=float, default=1e-15, help="a larger eps silently damps tiny gradients")
    g.add_argument("--grad_clip", type=float, default=1.0, help="max gradient norm; 0 = off")
    g.add_argument("--micro_prompts", type=int, default=0, help="prompts per forward/backward; 0 = the whole batch")
    g = ap.add_argument_group("evaluation, logging, checkpoints")
    g.add_argument("--eval_every", type=int, default=10, help="steps between held-out evals (paper: 100)")
    g.add_argument("--eval_samples", type=int, default=4, help="samples per held-out prompt, mean@k (paper: 16)")
    g.add_argument("--save_every", type=int, default=50, help="steps between checkpoints; 0 = only at the end")
    g.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    g.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    args = ap.parse_args(argv)
    for name in ("prompts", "samples", "think_budget", "answer_budget", "steps", "eval_every", "eval_samples", "slots"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} must be positive, got {getattr(args, name)}")
    return args

# -----------------------------------------------------------------------------
# rollouts: sample, decode, verify


def rollout(model, tokenizer, prompt_ids, golds, args, keys, version=0):
    """Sample one completion per prompt (keys: noise keys) and score it -> (samples, texts, correct)."""
    samples = generate(model, prompt_ids, eos_id=tokenizer.eos_token_id,
                       think_end=tokenizer("</think>", add_special_tokens=False)["input_ids"],
                       interrupt_ids=tokenizer(INTERRUPT_PHRASE, add_special_tokens=False)["input_ids"],
                       think_budget=args.think_budget, answer_budget=args.answer_budget,
                       interrupt=args.length_control == "interrupt", slots=args.slots,
                       temperature=args.temperature, fp32_head=args.fp32_head, seed=args.seed, keys=keys,
                       version=version)
    texts = [tokenizer.decode(s.tokens[:-1] if s.tokens[-1] == tokenizer.eos_token_id else s.tokens)
             for s in samples]
    return samples, texts, score_batch(texts, golds)


def evaluate(model, tokenizer, val_ids, val_golds, args):
    """Held-out mean@k pass rate; the same noise keys at every eval (less variance between evals)."""
    k = args.eval_samples
    keys = [10**12 + i for i in range(len(val_ids) * k)]
    samples, _, correct = rollout(model, tokenizer, val_ids * k, val_golds * k, args, keys)
    return {"pass_rate": float(np.mean(correct)), "trunc": float(np.mean([s.finish != "eos" for s in samples])),
            "n": len(correct)}


def rewards_of(samples, correct, args):
    """+1 correct, -1 otherwise; with --length_control penalty, correct answers also get the length penalty."""
    r = torch.tensor([1.0 if c else -1.0 for c in correct])
    if args.length_control == "penalty":
        l_max = args.l_max or args.think_budget + args.answer_budget
        lengths = torch.tensor([len(s.tokens) for s in samples])
        r = r + torch.tensor(correct, dtype=torch.float) * length_penalty(lengths, l_max, args.l_cache or l_max // 7)
    return r


def collate(prompt_ids, samples, pad_id, device):
    """Right-padded prompt+completion batch -> ids (N, T), attention (N, T), and, aligned with the
    next-token targets ids[:, 1:], the loss mask (N, T-1) and the generator's log-probs (N, T-1)."""
    T = max(len(p) + len(s.tokens) for p, s in zip(prompt_ids, samples))
    N = len(samples)
    ids = torch.full((N, T), pad_id, dtype=torch.long)
    attn = torch.zeros(N, T, dtype=torch.long)
    mask, gen_logp = torch.zeros(N, T - 1), torch.zeros(N, T - 1)
    for i, (p, s) in enumerate(zip(prompt_ids, samples)):
        P, C = len(p), len(s.tokens)
        ids[i, :P + C] = torch.tensor(p + s.tokens)
        attn[i, :P + C] = 1
        mask[i, P - 1:P - 1 + C] = torch.tensor(s.mask, dtype=torch.float)
        gen_logp[i, P - 1:P - 1 + C] = torch.tensor(s.logps)
    return ids.to(device), attn.to(device), mask.to(device), gen_logp.to(device)


def train_batch(model, batch, args, n_groups):
    """Forward/backward over micro-batches of whole prompt groups; gradients add up to the full-batch
    loss's (each micro-batch's loss is weighted by its share of groups, sequences or tokens)."""
    ids, attn, mask, gen_logp, adv, group = batch
    per = args.micro_prompts or n_groups
    uniq = group.unique()
    total = {"prompt": len(uniq), "sample": len(group), "token": mask.sum().item()}[args.agg]
    loss_sum, stats = 0.0, []
    for a in range(0, len(uniq), per):
        rows = torch.isin(group, uniq[a:a + per]).nonzero().squeeze(1)
        logp = sequence_logprobs(model, ids[rows], attn[rows], args.fp32_head, args.temperature)
        loss = policy_loss(logp, gen_logp[rows], adv[rows], mask[rows], group[rows], kind=args.loss,
                           agg=args.agg, eps_low=args.eps_low, eps_high=args.eps_high)
        share = {"prompt": len(uniq[a:a + per]), "sample": len(rows), "token": mask[rows].sum().item()}[args.agg]
        (loss * share / total).backward()
        loss_sum += loss.item() * share / total
        stats.append(ratio_stats(logp.detach(), gen_logp[rows], mask[rows]))
    mismatch = {k: float(np.mean([s[k] for s in stats])) for k in stats[0]}
    return loss_sum, mismatch

# -----------------------------------------------------------------------------
# checkpoints


def save_checkpoint(out, step, model, tokenizer, state, keep):
    """Write ckpt-STEP atomically (a temp folder renamed into place) and keep the newest `keep`."""
    final = os.path.join(out, f"ckpt-{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(state, os.path.join(tmp, "state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(glob.glob(os.path.join(out, "ckpt-*[0-9]")))[:-keep]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(out):
    ckpts = sorted(glob.glob(os.path.join(out, "ckpt-*[0-9]")))
    return ckpts[-1] if ckpts else None


def truncate_metrics(path, step):
    """On resume: drop metrics lines written after the checkpoint, so no step appears twice.
    -> the records kept."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        records = [json.loads(ln) for ln in f]
    records = [r for r in records if r.get("step", -1) <= step]  # the config line has no step
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return records

# -----------------------------------------------------------------------------
# data


def load_data(args):
    """-> (train problems, held-out problems); the toy task when --data is empty."""
    if args.data:
        problems = [p for path in args.data.split(",") for p in load_problems(path)]
    else:  # the embedded task: 3000 distinct generated problems
        seen = {}
        for p in toy_problems(4000, args.seed + 12345):
            seen.setdefault(p["prompt"], p)
        problems = list(seen.values())[:3000]
    if args.val_data:
        return problems, load_problems(args.val_data)
    return split_problems(problems, args.val_size, args.seed)


def log_line(m, steps):
    return (f"step {m['step']}/{steps} | reward {m['reward']:+.3f} | pass@1 {m['pass_rate']:.3f} | "
            f"len {m['len']:.1f} | trunc {m['trunc']:.3f} | lag {m['lag']:.1f} | kept {m['kept_prompts']}/{m['prompts']} | "
            f"loss {m['loss']:+.4f} | dt {m['dt_ms']:.0f} ms | tok/s {m['tok_s']:.0f}")


def main(args):
    # ---- setup: device, model, data, optimizer
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    ckpt = latest_checkpoint(args.out) if args.resume else None
    if args.resume and ckpt is None:
        print(f"--resume: no checkpoint in {args.out}, starting from scratch")
    model_dir = ckpt or args.model or toy_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(device)
    check_supported(model)
    n_params = sum(p.numel() for p in model.parameters())
    train, val = load_data(args)
    train_ids = [tokenizer(format_prompt(tokenizer, p["prompt"]))["input_ids"] for p in train]
    val_ids = [tokenizer(format_prompt(tokenizer, p["prompt"]))["input_ids"] for p in val]
    val_golds = [p["answer"] for p in val]
    curriculum = Curriculum(len(train), args.seed, npr=args.no_positive_resampling)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    step, compute_s, flops = 0, 0.0, 0.0
    evals = []  # (compute_s, held-out pass rate) of every eval so far, for the live fit
    if ckpt:
        state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        curriculum.load_state_dict(state["curriculum"])
        step, compute_s, flops = state["step"], state["compute_s"], state["flops"]
        torch.set_rng_state(state["torch_rng"])
        evals = [(r["compute_s"], r["pass_rate"]) for r in truncate_metrics(metrics_path, step) if r["kind"] == "eval"]
        print(f"resumed from {ckpt} at step {step}")
    else:
        with open(metrics_path, "w") as f:
            f.write(json.dumps({"kind": "config", **vars(args), "n_params": n_params}) + "\n")
    print(f"model {model_dir} ({n_params / 1e6:.2f}M params, {model.config.model_type}) on {device} | "
          f"{len(train)} train / {len(val)} held-out problems | {args.prompts} prompts x {args.samples} samples")

    def log_metrics(m):
        with open(metrics_path, "a") as f:
            f.write(json.dumps(m) + "\n")

    def run_eval():
        result = evaluate(model, tokenizer, val_ids, val_golds, args)
        m = {"kind": "eval", "step": step, "compute_s": compute_s, "flops": flops, **result}
        evals.append((compute_s, result["pass_rate"]))
        C, R = np.array(evals).T
        try:  # a diagnostic: a curve that cannot be fitted yet must not stop the run
            pred = predict_final(C, R, C_end=compute_s / max(step, 1) * args.steps)
        except ValueError as err:
            pred = None
            print(f"eval step {step}: no live fit ({err})")
        if pred:
            m.update(fit_A=pred["A"], fit_B=pred["B"], fit_C_mid=pred["C_mid"], predicted_final=pred["R_end"])
        log_metrics(m)
        fit_txt = (f" | fit A {pred['A']:.3f} B {pred['B']:.2f} C_mid {pred['C_mid']:.0f} -> predicted "
                   f"{pred['R_end']:.3f} at step {args.steps}") if pred else ""
        print(f"eval step {step} | held-out pass rate {result['pass_rate']:.3f} (mean@{args.eval_samples}, "
              f"n={result['n']}) | trunc {result['trunc']:.3f}{fit_txt}")

    def save():
        state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "curriculum": curriculum.state_dict(), "step": step, "compute_s": compute_s, "flops": flops,
                 "torch_rng": torch.get_rng_state(), "args": vars(args)}
        print(f"saved {save_checkpoint(args.out, step, model, tokenizer, state, args.keep)}")

    if step == 0:
        run_eval()
    while step < args.steps:
        # ---- rollouts: G samples per prompt with the current weights (sync: version = step, lag 0)
        t0 = time.time()
        try:
            idx = curriculum.next_batch(args.prompts)
        except StopIteration as e:
            print(f"stopping at step {step}: {e}")
            break
        prompt_ids = [train_ids[i] for i in idx for _ in range(args.samples)]
        golds = [train[i]["answer"] for i in idx for _ in range(args.samples)]
        keys = [(step * args.prompts + j // args.samples) * 1000 + j % args.samples for j in range(len(prompt_ids))]
        model.eval()
        samples, texts, correct = rollout(model, tokenizer, prompt_ids, golds, args, keys, version=step)
        t_gen = time.time() - t0
        rewards = rewards_of(samples, correct, args)
        group = torch.tensor([i for i in idx for _ in range(args.samples)])
        for j, i in enumerate(idx):  # samples come in blocks of G per prompt
            curriculum.record(i, float(np.mean(correct[j * args.samples:(j + 1) * args.samples])))

        # ---- batch: zero-variance filtering, advantages
        keep = zero_variance_keep(rewards, group) if args.zero_var_filter else torch.ones(len(rewards), dtype=torch.bool)
        rows = keep.nonzero().squeeze(1).tolist()
        loss_value, mismatch, grad_norm = 0.0, {}, 0.0
        if rows:
            ids, attn, mask, gen_logp = collate([prompt_ids[r] for r in rows], [samples[r] for r in rows],
                                                tokenizer.pad_token_id or 0, device)
            adv = advantages(rewards[rows], group[rows], args.adv_norm).to(device)

            # ---- train: loss, backward, clip, AdamW step
            model.train()
            loss_value, mismatch = train_batch(model, (ids, attn, mask, gen_logp, adv, group[rows].to(device)), args,
                                               len(set(group[rows].tolist())))
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf")).item()
            if math.isfinite(grad_norm):
                opt.step()
                sched.step()
            else:
                print(f"step {step}: non-finite gradient norm, optimizer step skipped")
            opt.zero_grad(set_to_none=True)
        step += 1

        # ---- accounting and logging
        dt = time.time() - t0
        compute_s += dt * 1  # one device in this process
        gen_tokens = sum(len(p) + len(s.tokens) for p, s in zip(prompt_ids, samples))
        flops += 2 * n_params * gen_tokens + 6 * n_params * sum(len(prompt_ids[r]) + len(samples[r].tokens) for r in rows)
        m = {"kind": "train", "step": step, "compute_s": compute_s, "flops": flops,
             "reward": rewards.mean().item(), "pass_rate": float(np.mean(correct)),
             "len": float(np.mean([len(s.tokens) for s in samples])),
             "trunc": float(np.mean([s.finish != "eos" for s in samples])),
             "interrupted": float(np.mean([s.finish == "interrupted" for s in samples])),
             "lag": 0.0, "prompts": len(idx), "kept_prompts": len(set(group[rows].tolist())),
             "dropped_zero_var": len(idx) - len(set(group[rows].tolist())), "retired": len(curriculum.retired),
             "epoch": curriculum.epoch, "loss": loss_value, "grad_norm": grad_norm, "lr": sched.get_last_lr()[0],
             "dt_ms": dt * 1000, "tok_s": sum(len(s.tokens) for s in samples) / t_gen,
             **{f"mismatch_{k}": v for k, v in mismatch.items()}}
        log_metrics(m)
        print(log_line(m, args.steps))

        # ---- eval and checkpoint
        if step % args.eval_every == 0 or step == args.steps:
            run_eval()
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            save()
    if step % args.eval_every and step != args.steps:  # stopped early: every prompt retired
        run_eval()
        save()


if __name__ == "__main__":
    main(get_args())
