"""
train.py: the ScaleRL training loop (arXiv 2510.13786). Start at `main`: each step
`source.get` gives verified groups (pipeline.py), `make_batch` keeps the samples that train and
computes advantages, `train_step` takes the CISPO loss and an AdamW step, and `source.publish`
sends the weights to the sampler. One process, torchrun and FSDP2 differ only in the rollout source
and the trainer, chosen at start-up. Every ScaleRL choice is a flag; sizes come from RECIPES.

    python train.py                            # the embedded toy task and model, on a CPU
    python train.py --loss dapo --no-fp32_head # an ablation: one flag per ScaleRL choice
    torchrun $LOCAL --nproc_per_node 8 train.py --model DIR --data FILE --gen_ranks 6 --fsdp
"""

import argparse
import glob
import json
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from checks import check_args, check_code_rewards, check_model_dir, context_error, did_you_mean
import evals
from data import (format_prompt, load_source_problems, prompts_ids, read_jsonl, special_tokens,
                  split_problems)
import faults
import pipeline
import plan
from generate import check_supported, packed_logprobs
from loss import (AGGS, EPS_DEFAULTS, NORMS, OBJECTIVES, advantages, agg_counts, clip_eps,
                  drift_by_lag, forgetting, ratio_stats, row_weights, zero_variance_keep)
from metrics import alarms, log_eval, log_step, new_record, print0, step_metrics
from runs import (checkpoint_tmp, checkpoints, metrics_log, prepare_out_dir,
                  release_lock, resume_command, resume_point, safe_load_planner, save_checkpoint,
                  shard_reader)
from toy import PRESETS, toy_model_dir, toy_task

# -----------------------------------------------------------------------------
# flags: ScaleRL's choices by default

LENGTH_CONTROLS = ("interrupt", "penalty", "none")

SHARDS = "shards"  # a --fsdp checkpoint's sharded state

# --recipe's sizes (paper: appendix A.3); a flag given overrides
RECIPES = {
    "toy": dict(prompts=16, samples=8, think_budget=48, answer_budget=64, lr=2e-4, warmup=10,
                steps=150, eval_every=10, eval_samples=4, val_size=None, save_every=50,
                dtype="float32", neg_trust=0.5, grad_clip=1.0),
    "paper": dict(prompts=48, samples=16, think_budget=12288, answer_budget=2048, lr=5e-7,
                  warmup=100, steps=2000, eval_every=100, eval_samples=16, val_size=1000,
                  save_every=100, dtype="bfloat16", neg_trust=0.0, grad_clip=0.0),
    "one_gpu": dict(prompts=16, samples=8, think_budget=4096, answer_budget=1024, lr=1e-6,
                    warmup=20, steps=500, eval_every=50, eval_samples=4, val_size=500,
                    save_every=100, dtype="bfloat16", neg_trust=0.0, grad_clip=0.0),
}


class FlagParser(argparse.ArgumentParser):
    """argparse: one-line errors, no abbreviations."""

    def __init__(self, **kw):
        super().__init__(allow_abbrev=False, formatter_class=RecipeHelpFormatter, **kw)

    def error(self, message):
        flags = [o for a in self._actions for o in a.option_strings]
        faults.say_error(f"{self.prog}: error: {message}{did_you_mean(message, flags)} "
                         "(--help lists the flags)")  # under torchrun: once
        self.exit(2)


class RecipeHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        if action.dest not in RECIPES["toy"]:
            return action.help if action.default is None else super()._get_help_string(action)
        show = lambda v: "auto" if v is None else f"{v:g}" if isinstance(v, float) else v
        values = ", ".join(f"{name} {show(r[action.dest])}" for name, r in RECIPES.items())
        return f"{action.help} (recipe: {values})"


def model_flags(g):
    g.add_argument("--model", default="",
                   help="HF model folder or Hugging Face Hub id, e.g. Qwen/Qwen3-0.6B "
                        "(Llama/Qwen2/Qwen3; a Hub id is downloaded once into the Hugging Face "
                        "cache, HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE apply); empty = the "
                        "embedded base model of the --data preset")
    g.add_argument("--data", default="",
                   help="training jsonl or Hugging Face dataset owner/name[:config[:split]] "
                        "(split default train; e.g. openai/gsm8k:main; pip install datasets), or "
                        "several comma-separated (math and code mix); 'toy' or empty = the "
                        "embedded toy task; 'toy-hard' = the study's harder one (toy.PRESETS)")
    g.add_argument("--unsafe_code_exec", action="store_true",
                   help="code problems: run programs with resource limits only when bubblewrap "
                        "(bwrap) is missing; a program can then forge its reward (sandbox.py)")
    g.add_argument("--val_data", default="",
                   help="held-out jsonl or Hugging Face dataset owner/name[:config[:split]] "
                        "(split default test; e.g. openai/gsm8k:main, HuggingFaceH4/MATH-500); "
                        "empty = hold out --val_size problems of --data")
    g.add_argument("--val_size", type=int, default=None,
                   help="held-out problems (toy: 200, or a tenth of a --data of fewer than 2,000 "
                        "problems)")
    g.add_argument("--out", default=None,
                   help="output folder: metrics.jsonl and checkpoints; None = runs/ and the run's "
                        "shape: its data, and under torchrun its ranks, mode and --fsdp "
                        "(runs/toy, runs/toy-2ranks, runs/gsm8k-8ranks-fsdp, ...)")
    g.add_argument("--device", default="auto", help="auto = cuda when available, else cpu")
    g.add_argument("--recipe", default="auto", choices=["auto", *RECIPES],
                   help="the sizes and rates to start from (RECIPES; a flag given overrides its "
                        "value, and the start-up line names each one that differs): auto = toy "
                        "for the embedded tasks, paper for any --model")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="the weights' dtype for sampling and the loss's forward and backward; "
                        "AdamW always steps a float32 master copy (no float16: its gradients "
                        "underflow without loss scaling, which train.py does not do)")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the split, the curriculum and the sampling noise")


def rollout_flags(g):
    g.add_argument("--prompts", type=int, default=None,
                   help="prompts per optimizer step")
    g.add_argument("--samples", type=int, default=None,
                   help="completions per prompt, G")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (paper: 1.0)")
    g.add_argument("--slots", type=int, default=None,
                   help="rows the sampler decodes at once (continuous batching); None = 128 on "
                        "CPU, as many as --gen_memory fits on CUDA, at most what a generator can "
                        "have in flight (--slots caps them too)")
    g.add_argument("--gen_memory", type=float, default=0.85,
                   help="CUDA: the fraction of the device memory left after the weights that the "
                        "sampler's KV cache may take (vLLM's gpu_memory_utilization); the "
                        "sequences that fit at their mean length are printed; ranks sharing one "
                        "GPU: lower it")
    g.add_argument("--think_budget", type=int, default=None,
                   help="thinking tokens")
    g.add_argument("--answer_budget", type=int, default=None,
                   help="answer tokens after </think>; room for a rethought chain keeps a "
                        "format change scored (-1) rather than truncated (no gradient)")
    g.add_argument("--length_control", default="interrupt", choices=LENGTH_CONTROLS,
                   help="interrupt = forced interruption (ScaleRL); penalty = a length penalty")
    g.add_argument("--l_max", type=int, default=0,
                   help="length penalty L_max; 0 = think_budget + answer_budget")
    g.add_argument("--l_cache", type=int, default=0,
                   help="length penalty L_cache; 0 = l_max // 7 (paper: 2k of 14k)")


def loss_flags(g):
    g.add_argument("--loss", default="cispo", choices=list(EPS_DEFAULTS),
                   help="policy loss: CISPO is ScaleRL's; the others are ablations (loss.py)")
    g.add_argument("--agg", default="prompt", choices=AGGS, help="loss aggregation")
    g.add_argument("--adv_norm", default="batch", choices=NORMS, help="advantage normalization")
    g.add_argument("--eps_low", type=float, default=None,
                   help="None = the loss kind's default: cispo none, grpo/dapo 0.2, gspo 3e-3 "
                        "(the paper, section 3.2)")
    g.add_argument("--eps_high", type=float, default=None,
                   help="None = the loss kind's default: cispo 4 (the cap on the IS weight), grpo "
                        "0.2, dapo 0.28, gspo 4e-3")
    g.add_argument("--neg_trust", type=float, default=None,
                   help="cispo: a token of a negative-advantage sample whose IS ratio has fallen "
                        "below this gives no gradient (CISPO's token mask M, as PPO clips A < 0); "
                        "0 = off, the paper's CISPO; the toy's 0.5: BENCHMARKS.md section 6")
    g.add_argument("--fp32_head", action=argparse.BooleanOptionalAction, default=True,
                   help="float32 LM head")
    g.add_argument("--zero_var_filter", action=argparse.BooleanOptionalAction, default=True,
                   help="drop prompts whose rewards are all equal")
    g.add_argument("--keep_truncated", action="store_true",
                   help="an ablation: keep truncated samples (no eos within the budget) in the "
                        "loss, with reward -1 (a truncated sample is never correct); default: "
                        "excluded from the loss and the group statistics (paper A.15's effective "
                        "batch)")
    g.add_argument("--no_positive_resampling", action=argparse.BooleanOptionalAction, default=True,
                   help="never resample a prompt once its pass rate reaches 0.9")


def optimization_flags(g):
    g.add_argument("--steps", type=int, default=None, help="optimizer steps")
    g.add_argument("--lr", type=float, default=None,
                   help="learning rate (the toy's: BENCHMARKS.md section 6)")
    g.add_argument("--warmup", type=int, default=None,
                   help="linear warm-up steps")
    g.add_argument("--weight_decay", type=float, default=0.01,
                   help="AdamW weight decay (paper: 0.01)")
    g.add_argument("--adam_eps", type=float, default=1e-15,
                   help="a larger eps silently damps tiny gradients")
    g.add_argument("--grad_clip", type=float, default=None,
                   help="max gradient norm; 0 = off, the paper's (AdamW eps 1e-15 instead); the "
                        "toy's 1 is a toy setting (README, \"Recipes\")")
    g.add_argument("--micro_tokens", type=int, default=8192,
                   help="tokens per forward/backward, rows packed into one (a row longer than "
                        "that alone): the trainer's activations are sized by it, not by the group "
                        "or the sample length; 0 = the whole batch at once")
    g.add_argument("--ckpt_layers", default="auto", choices=["auto", "on", "off"],
                   help="recompute each decoder layer in the backward (activation checkpointing: "
                        "a layer keeps its input alone); auto = on above 4 layers")
    g.add_argument("--max_bad_steps", type=int, default=3,
                   help="consecutive steps with a NaN/inf loss or gradient (each skipped) before "
                        "the run stops")
    g.add_argument("--max_empty_steps", type=int, default=10,
                   help="consecutive steps that keep no prompt (every group all truncated or with "
                        "equal rewards: nothing to train on) before the run stops and says why")


def rank_flags(g):
    g.add_argument("--mode", default="pipeline", choices=["pipeline", "ppo_offpolicy", "sync"],
                   help="pipeline = PipelineRL-k (ScaleRL); ppo_offpolicy = PPO-off-policy-k; "
                        "sync = k of 1")
    g.add_argument("--max_lag", type=int, default=8,
                   help="k: no token trained on is more than k versions old")
    g.add_argument("--gen_ranks", type=int, default=0,
                   help="generator ranks; 0 = world - max(1, world // 4)")
    g.add_argument("--timeout", type=float, default=1800,
                   help="seconds any cross-rank wait may last")
    g.add_argument("--heartbeat_timeout", type=float, default=60,
                   help="seconds of silence before a rank is declared dead")
    g.add_argument("--bucket_mb", type=int, default=256, help="weight broadcast bucket size")
    g.add_argument("--fsdp", action="store_true",
                   help="shard the trainers' model and optimizer state over the trainer ranks "
                        "(FSDP2); no trainer keeps a whole copy, and checkpoints keep the float32 "
                        "shards and AdamW state sharded")


def logging_flags(g):
    g.add_argument("--eval_every", type=int, default=None,
                   help="steps between held-out evals")
    g.add_argument("--log_every", type=int, default=1,
                   help="print the step line every N steps (and the last one); metrics.jsonl "
                        "keeps every step")
    g.add_argument("--eval_samples", type=int, default=None,
                   help="samples per held-out prompt, mean@k")
    g.add_argument("--eval_only", action="store_true",
                   help="only evaluate --model (default: the --data preset's base model) on "
                        "--val_data (default: the held-out split of --data), print the pass rate "
                        "and exit")
    g.add_argument("--wandb", default="", metavar="PROJECT",
                   help="also log metrics to Weights & Biases (pip install wandb; "
                        "WANDB_MODE=offline works without a network)")
    g.add_argument("--tensorboard", action="store_true",
                   help="also log metrics as TensorBoard events in --out/tb (pip install "
                        "tensorboard)")
    g.add_argument("--save_every", type=int, default=None,
                   help="steps between checkpoints; 0 = only at the end")
    g.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest intact checkpoint in --out")
    g.add_argument("--overwrite", action="store_true",
                   help="start over in an --out that holds a run: its metrics, checkpoints and "
                        "curriculum files are deleted first (without it or --resume such an --out "
                        "is refused)")


def make_parser():
    ap = FlagParser(prog="train.py", description="ScaleRL training loop")
    model_flags(ap.add_argument_group("model and data"))
    rollout_flags(ap.add_argument_group("rollouts"))
    loss_flags(ap.add_argument_group("loss (loss.py)"))
    optimization_flags(ap.add_argument_group("optimization"))
    rank_flags(ap.add_argument_group("ranks (pipeline.py; under torchrun only)"))
    logging_flags(ap.add_argument_group("evaluation, logging, checkpoints"))
    return ap


def get_args(argv=None):
    ap = make_parser()
    args = ap.parse_args(argv)
    # --resume compares args.model as typed
    args.model_dir = check_model_dir(args.model, ap.error)
    apply_recipe(args)
    args.out = args.out or default_out(args)
    check_args(args, ap.error)
    return args


def default_out(args):
    """runs/ and the run's shape: runs/toy, runs/gsm8k-8ranks-fsdp."""
    name = "+".join(os.path.splitext(os.path.basename(p.split(":")[0].rstrip("/")))[0] or p
                    for p in (args.data or "toy").split(","))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        name += f"-{world}ranks" + ("" if args.mode == "pipeline" else f"-{args.mode}") + \
            ("-fsdp" if args.fsdp else "")
    return os.path.join("runs", name)


def apply_recipe(args):
    """--recipe auto: toy for the embedded models, else paper; fill the flags not given."""
    if args.recipe == "auto":
        task = ""
        if args.model_dir and os.path.isfile(os.path.join(args.model_dir, "config.json")):
            with open(os.path.join(args.model_dir, "config.json")) as f:
                task = json.load(f).get("scalerl_task", "")
        args.recipe = "toy" if not args.model_dir or task in PRESETS else "paper"
    for name, value in RECIPES[args.recipe].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


# -----------------------------------------------------------------------------
# data, model, evals


def load_data(args):
    problems = [p for path in (args.data or "toy").split(",")
                for p in load_source("--data", path, args.seed)]
    if args.val_data:
        return problems, load_source("--val_data", args.val_data, args.seed)
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


def pick_threads():
    """Half the cores as torch threads unless OMP_NUM_THREADS says (BENCHMARKS.md section 9)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // 2)))
    return torch.get_num_threads()


def pick_device(args, ctx=None):
    if ctx:
        return torch.device(ctx.device)
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def load_model(model_dir, args, device):
    """-> (tokenizer, model in --dtype on device); no folder's code runs."""
    weights = sum(os.path.getsize(f) for f in glob.glob(os.path.join(model_dir, "*.safetensors")) +
                  glob.glob(os.path.join(model_dir, "*.bin")))
    if weights > 1e8:
        print0(f"loading {model_dir} ({weights / 1e9:.1f} GB of weights) onto {device} ...",
               flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        for domain in ("math", "code"):
            format_prompt(tokenizer, "", domain)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, args.dtype), trust_remote_code=False).to(device)
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


def eval_model(model, tokenizer, val_ids, val, args, most=None):
    """evals.evaluate with the run's sampler: one sequence per sample at most (or `most`)."""
    n = len(val_ids) * args.eval_samples
    steps = pipeline.make_sampler(model, tokenizer, args, max(map(len, val_ids)),
                                  most=min(n, most or n))
    return evals.evaluate(steps, tokenizer, val_ids, val, args.eval_samples, args.unsafe_code_exec)


def eval_only(args):
    """--eval_only: the held-out mean@k of --model, printed."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.exit("error: --eval_only runs as one process: python train.py --eval_only ..., "
                 "not under torchrun")
    _, val = load_data(args)
    note_toy_model(args, args.val_data, "--val_data", "evaluates")
    model_dir = args.model_dir or base_model_dir(args)
    tokenizer, model = load_model(model_dir, args, pick_device(args))
    val_ids = tokenize_prompts(tokenizer, val)
    plan.print_memory_plan(model.config, args, None, next(model.parameters()).device,
                               max(map(len, val_ids)),
                               len(special_tokens(tokenizer)["interrupt_ids"]),
                               evaluate=len(val) * args.eval_samples)
    t0 = time.time()
    r = eval_model(model.eval(), tokenizer, val_ids, val, args)
    held = args.val_data or f"{len(val)} held-out problems of " + \
        (f"--data {args.data}" if args.data else "the toy task")
    print(evals.eval_only_line(r, f"eval {args.model or model_dir} on {held}", args.eval_samples,
                               len(val), time.time() - t0), flush=True)
    return r

# -----------------------------------------------------------------------------
# the batch and the step


@dataclass
class Batch:
    """One trainer's part of a step's batch."""
    prompt_ids: list
    samples: list
    correct: list
    rewards: torch.Tensor
    group: torch.Tensor
    truncated: torch.Tensor
    valid: torch.Tensor  # (N,) untruncated, unless --keep_truncated
    rows: list
    adv: torch.Tensor
    # every trainer's counts: the loss's denominators
    sums: dict


def make_batch(groups, args, all_sum=None):
    """Rewards, truncated samples out, the zero-variance filter, advantages (all_sum: over the
    trainers)."""
    samples = [s for g in groups for s in g["samples"]]
    correct = [c for g in groups for c in g["correct"]]
    rewards = torch.tensor([r for g in groups for r in g["rewards"]])
    _, penalty = pipeline.length_control(args)
    if penalty:
        lengths = torch.tensor([len(s.tokens) for s in samples])
        rewards = rewards + torch.tensor(correct, dtype=torch.float) * penalty(lengths)
    group = torch.tensor([j for j, g in enumerate(groups) for _ in g["samples"]], dtype=torch.long)
    truncated = torch.tensor([s.finish == "truncated" for s in samples], dtype=torch.bool)
    valid = torch.ones(len(samples), dtype=torch.bool) if args.keep_truncated else ~truncated
    keep = zero_variance_keep(rewards, group, valid) if args.zero_var_filter else valid
    rows = keep.nonzero().squeeze(1).tolist()
    adv = advantages(rewards[rows], group[rows], args.adv_norm, all_sum=all_sum)
    masks = [torch.tensor(samples[r].mask) for r in rows]
    sums = (all_sum or dict)(agg_counts(group[rows], torch.cat(masks) if masks else torch.zeros(0)))
    return Batch([g["prompt"] for g in groups for _ in g["samples"]], samples, correct, rewards,
                 group, truncated, valid, rows, adv, sums)


def collate(prompt_ids, samples, pad_id, device, step=0):
    """Right-padded rows -> ids, attention, and per target token the loss mask, generator log-probs,
    lag."""
    T = max(len(p) + len(s.tokens) for p, s in zip(prompt_ids, samples))
    N = len(samples)
    ids = torch.full((N, T), pad_id, dtype=torch.long)
    attn, lag = torch.zeros(N, T, dtype=torch.long), torch.zeros(N, T - 1, dtype=torch.long)
    mask, gen_logp = torch.zeros(N, T - 1), torch.zeros(N, T - 1)
    for i, (p, s) in enumerate(zip(prompt_ids, samples)):
        P, C = len(p), len(s.tokens)
        ids[i, :P + C] = torch.tensor(p + s.tokens)
        attn[i, :P + C] = 1
        mask[i, P - 1:P - 1 + C] = torch.tensor(s.mask, dtype=torch.float)
        gen_logp[i, P - 1:P - 1 + C] = torch.tensor(s.logps)
        lag[i, P - 1:P - 1 + C] = step - torch.tensor(s.versions, dtype=torch.long)
    return ids.to(device), attn.to(device), mask.to(device), gen_logp.to(device), lag.to(device)


def pack(prompt_ids, samples, device):
    rows = [p + s.tokens for p, s in zip(prompt_ids, samples)]
    return torch.tensor([t for r in rows for t in r], device=device), [len(r) for r in rows]


def micro_batches(lengths, budget):
    """Rows packed first-fit into micro-batches of at most `budget` tokens (0: one) -> positions."""
    parts, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = next((j for j, r in enumerate(room) if not budget or lengths[i] <= r), None)
        if j is None:
            parts.append([i])
            room.append(budget - lengths[i])
        else:
            parts[j].append(i)
            room[j] -= lengths[i]
    return parts


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
    # each row's weight in the whole batch's loss
    weights = row_weights(batch.group[rows], tokens, args.agg, batch.sums).to(device)
    eps_low, eps_high = clip_eps(args.loss, args.eps_low, args.eps_high)
    loss_sum, stats = 0.0, []
    for part in trainer.micro_batches(batch):
        prompts = [batch.prompt_ids[rows[i]] for i in part]
        samples = [batch.samples[rows[i]] for i in part]
        _, _, mask, gen_logp, lag = collate(prompts, samples, 0, device, trainer.version)
        logp = trainer.logprobs(*pack(prompts, samples, device))
        keep, at = mask.bool(), torch.tensor(part, device=device)
        log_ratio = torch.where(keep, logp - gen_logp, 0.0)
        obj = OBJECTIVES[args.loss](log_ratio, logp, adv[at][:, None], keep, eps_low, eps_high,
                                    args.neg_trust or None)  # CISPO by default
        loss = -(torch.where(keep, obj, 0.0).sum(1) * weights[at].to(logp.dtype)).sum()
        loss.backward()
        trainer.accumulate()
        loss_sum += loss.item()
        stats.append(micro_stats(logp.detach(), gen_logp, mask, lag, args))
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


def micro_stats(logp, gen_logp, mask, lag, args):
    """A micro-batch's mismatch, drift by lag and forgetting."""
    return (ratio_stats(logp, gen_logp, mask, args.loss, args.eps_high),
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

# -----------------------------------------------------------------------------
# the trainer


def master_weights(model, saved=None):
    """Half-dtype weights: float32 copies for AdamW (bf16 steps round small updates away), else
    None."""
    params = list(model.parameters())
    if params[0].dtype not in (torch.bfloat16, torch.float16):
        return None
    return [torch.nn.Parameter(s.to(p.device) if s is not None else p.detach().float())
            for p, s in zip(params, saved or [None] * len(params))]


class Trainer:
    """The replicated trainer: AdamW with a linear warm-up on float32 weights; `version` counts its
    steps."""
    sharded = False
    def __init__(self, args, model, ctx, state, ckpt=None, pad_id=0):
        self.args, self.model, self.ctx, self.ckpt, self.pad_id = args, model, ctx, ckpt, pad_id
        # None: one process
        self.ranks_sum = None if ctx is None else self.all_sum
        self.n_params = sum(p.numel() for p in model.parameters())
        self.master = self.optimized_weights(state)
        self.opt = torch.optim.AdamW(self.master or model.parameters(), lr=args.lr,
                                     eps=args.adam_eps, weight_decay=args.weight_decay,
                                     betas=(0.9, 0.999))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: self.warmup(s))
        self.version, self.bad_steps = state.get("step", 0), 0
        if state:
            self.load_state_dict(state)

    def warmup(self, s):
        return min(1.0, (s + 1) / self.args.warmup)

    def optimized_weights(self, state):
        """The float32 weights AdamW steps (None: the model's)."""
        return master_weights(self.model, state.get("master"))

    def logprobs(self, ids, lens):
        return packed_logprobs(self.model, ids, lens, self.args.fp32_head, self.args.temperature,
                               checkpoint_layers=self.args.ckpt_layers)

    def all_sum(self, sums):
        """Sum a dict over the trainer ranks."""
        return pipeline.all_reduce_stats(self.ctx, sums)[0]

    def any(self, flag):
        return self.all_sum({"flag": bool(flag)})["flag"] > 0

    def clip_grads(self):
        """-> the gradient norm before clipping."""
        stepped = self.master or list(self.model.parameters())
        norm = torch.nn.utils.clip_grad_norm_(stepped, self.args.grad_clip or float("inf"))
        return pipeline.whole(norm).item()

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def micro_batches(self, batch):
        return micro_batches([len(batch.prompt_ids[r]) + len(batch.samples[r].tokens)
                              for r in batch.rows], self.args.micro_tokens)

    def accumulate(self):
        """After each micro-batch's backward: half-dtype gradients move into the float32 copies."""
        for p, m in zip(self.model.parameters(), self.master or []):
            if p.grad is not None:
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                p.grad = None

    def reduce_grads(self):
        """Sum the trainers' gradients."""
        if self.ctx is not None:
            pipeline.all_reduce_grads(self.ctx, self.master or list(self.model.parameters()))

    def copy_master(self):
        """The model's weights := the float32 copies."""
        if self.master:
            with torch.no_grad():
                for p, m in zip(self.model.parameters(), self.master):
                    p.copy_(m)

    def skip_step(self, loss, norm):
        """No update; --max_bad_steps in a row stop the run."""
        self.bad_steps += 1
        print0(f"step {self.version + 1}: loss {loss} / gradient norm {norm}: not finite, "
               f"optimizer step skipped ({self.bad_steps} in a row, --max_bad_steps "
               f"{self.args.max_bad_steps})", flush=True)
        if self.bad_steps >= self.args.max_bad_steps:
            raise SystemExit(f"error: {self.bad_steps} consecutive steps with a non-finite loss "
                             f"or gradient (up to step {self.version + 1}); stopping. The last "
                             "checkpoint holds the last good weights.")

    def eval_model(self, device=None):
        return self.model

    def save_shards(self, folder):
        """FSDP2 only."""

    def optimizer_state(self):
        return {"optimizer": self.opt.state_dict(),
                "master": [m.detach().cpu() for m in self.master] if self.master else None}

    def state_dict(self):
        return {**self.optimizer_state(), "scheduler": self.sched.state_dict(),
                "step": self.version, "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, state):
        self.load_optimizer(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        # the flags given now apply from here
        for group in self.opt.param_groups:
            group.update(lr=self.args.lr * self.warmup(self.sched.last_epoch),
                         initial_lr=self.args.lr, eps=self.args.adam_eps,
                         weight_decay=self.args.weight_decay, betas=(0.9, 0.999))
        self.sched.base_lrs = [self.args.lr] * len(self.opt.param_groups)

    def load_optimizer(self, saved):
        self.opt.load_state_dict(saved)


class ShardedTrainer(Trainer):
    """--fsdp: model and AdamW state sharded over the trainers (FSDP2); whole weights are gathered a
    parameter at a time."""
    sharded = True

    def optimized_weights(self, state):
        """Shard the model in place (float32 shards)."""
        model, ctx = self.model, self.ctx
        self.dtype = dtype = next(model.parameters()).dtype
        if dtype != torch.float32:
            model.float()
        self.forward = pipeline.shard_trainer(model, ctx.trainers, ctx.device, dtype)
        self.sync_once = plan.fsdp_sync_once(self.n_params, plan.device_bytes(ctx.device))
        local = sum(p.to_local().numel() for p in model.parameters())
        print0(f"FSDP2: trainer 0 holds {local} of {self.n_params} parameters (and their AdamW "
               "state)", flush=True)
        return None

    def logprobs(self, ids, lens):
        return self.forward(ids, lens, self.args.fp32_head, self.args.temperature,
                            self.args.ckpt_layers)

    def micro_batches(self, batch):
        """A trainer with fewer micro-batches runs empty passes: each is a chain of collectives."""
        parts = super().micro_batches(batch)
        self.n_all = int(pipeline.all_reduce_stats(self.ctx, {}, {"n": len(parts)})[1]["n"])
        self.done = 0
        self.forward.set_requires_gradient_sync(not self.sync_once or self.n_all == 1)
        for _ in range(len(parts), self.n_all):
            ids = torch.full((2,), self.pad_id, device=self.ctx.device)
            (self.logprobs(ids, [2]).sum() * 0).backward()
            self.accumulate()
        return parts

    def accumulate(self):
        """Reduce-scatter after the last micro-batch (or after each: plan.fsdp_sync_once)."""
        self.done += 1
        self.forward.set_requires_gradient_sync(not self.sync_once or self.done >= self.n_all - 1)

    def reduce_grads(self):
        pass  # FSDP2 reduce-scatters the gradients in the backward

    def eval_model(self, device=None):
        """The whole model in --dtype on trainer 0 (a collective; None elsewhere)."""
        whole = None
        if self.ctx.rank == 0:
            with torch.device("meta"):
                whole = AutoModelForCausalLM.from_config(self.model.config, dtype=self.dtype)
            whole.to_empty(device="cpu")
            whole.tie_weights()  # to_empty leaves a tied head its own tensor
            for b, ours in zip(whole.buffers(), self.model.buffers()):  # the rotary tables
                b.copy_(ours)
        params = dict(whole.named_parameters()) if whole else {}
        names = (name for name, _ in self.model.named_parameters())
        with torch.no_grad():
            for name, full in zip(names, pipeline.whole_weights(self.model, self.dtype)):
                if whole is not None:
                    params[name].copy_(full)
        return whole.to(device) if whole is not None and device else whole

    def save_shards(self, folder):
        """Each trainer writes its shards and AdamW state."""
        import torch.distributed.checkpoint as dcp
        self.any(False)  # a barrier
        dcp.save(pipeline.sharded_state(self.model, self.opt),
                 checkpoint_id=os.path.join(folder, SHARDS), process_group=self.ctx.trainers)

    def optimizer_state(self):
        return {"optimizer": None, "master": None, "shards": SHARDS}

    def load_optimizer(self, saved):
        """This trainer's saved shards and their AdamW state."""
        import torch.distributed.checkpoint as dcp
        folder = os.path.join(self.ckpt, SHARDS)
        state = pipeline.sharded_state(self.model, self.opt)
        dcp.load(state, storage_reader=shard_reader(folder),  # nothing in the folder runs code
                 process_group=self.ctx.trainers, planner=safe_load_planner())
        pipeline.set_sharded_state(self.model, self.opt, state)

# -----------------------------------------------------------------------------
# evals and checkpoints


def run_eval(rec, model, env, step, stamp):
    result = eval_model(model.eval(), env.tokenizer, env.val_ids, env.val, env.args,
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
    model, state = trainer.eval_model(), trainer.state_dict()
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
    ctx: object  # pipeline.Context; None for one process
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
    hf_logging.disable_progress_bar()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    train, val = load_data(args)
    check_code_rewards(args, train + val)
    prepare_out_dir(args)
    log = metrics_log(args, rank0)  # checks --wandb/--tensorboard before ranks wait
    note_toy_model(args, args.data, "--data", "trains")
    ckpt, state = resume_point(args, quiet=not rank0)
    ctx = pipeline.setup(args)
    if ctx is None and pick_device(args).type == "cpu":
        print(f"torch threads: {pick_threads()} of {os.cpu_count()} cores", flush=True)
    torch.manual_seed(args.seed)
    model_dir = ckpt or args.model_dir or base_model_dir(args)
    tokenizer, model = load_model(model_dir, args, pick_device(args, ctx))
    train_ids, val_ids = tokenize_prompts(tokenizer, train), tokenize_prompts(tokenizer, val)
    phrase_len = len(special_tokens(tokenizer)["interrupt_ids"])
    if (why := context_error(args, getattr(model.config, "max_position_embeddings", None),
                             max(map(len, train_ids + val_ids)), phrase_len)):
        sys.exit(f"error: {why}")
    if ctx:  # a packed rollout row's tokens per sample
        pipeline.start(ctx, state.get("step", 0),
                       max(map(len, train_ids)) + args.think_budget + args.answer_budget +
                       phrase_len)
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


def recipe_values(args, n_val):
    clip = f"grad clip {args.grad_clip:g}" if args.grad_clip else "no grad clip"
    mask = f"--neg_trust {args.neg_trust:g}" if args.neg_trust else "no CISPO mask"
    return (f"{args.prompts} prompts x {args.samples} samples | think {args.think_budget} + answer "
            f"{args.answer_budget} tokens | {args.steps} steps, lr {args.lr:g}, warm-up "
            f"{args.warmup}, {clip}, {mask} | eval every {args.eval_every} on {n_val} held-out x "
            f"{args.eval_samples} | save every "
            f"{args.save_every} | {args.dtype}")


def describe(env, trainer):
    """Rank 0's start-up lines."""
    args, ctx = env.args, env.ctx
    print0(f"recipe {args.recipe}: " + recipe_values(args, len(env.val)))
    defaults = vars(make_parser().parse_args([])) | RECIPES[args.recipe]
    flag = lambda k, v: f"--{k}" if v is True else f"--no-{k}" if v is False else f"--{k} {v}"
    given = [flag(k, getattr(args, k)) for k, v in defaults.items()
             if k not in ("recipe", "out") and getattr(args, k) != v]
    print0(f"flags that differ from it and the defaults: {' '.join(given) or 'none'}")
    roles = (f"{ctx.n_trainers} trainer + {ctx.n_gens} generator ranks, {args.mode}, "
             f"max lag {ctx.k}" if ctx else "one process, synchronous and on-policy")
    device = next(env.model.parameters()).device
    print0(f"model {env.model_dir} ({trainer.n_params / 1e6:.2f}M params, "
           f"{env.model.config.model_type}) on {device} | {roles} | {len(env.train)} train / "
           f"{len(env.val)} held-out problems")
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
    if trainer.version == 0:
        held_out_eval(rec, env, trainer, source)
    rec.saved = rec.evaluated = trainer.version  # step 0 is evaluated; a resumed step was saved
    stopped, signaled = None, False
    while trainer.version < args.steps:
        if trainer.any(source.stop_requested()):  # SIGINT / SIGTERM to any rank: save, then stop
            signaled = True
            break
        # ---- rollouts
        t0 = time.time()
        groups, rstats = source.get(trainer.version)
        if groups is None:  # a signal stopped the sampling
            signaled = True
            break
        if trainer.any(len(groups) < source.share):
            stopped = (f"stopping at step {trainer.version}: out of prompts "
                       "(No-Positive-Resampling retired every one)")
            print0(stopped, flush=True)
            break
        # ---- the batch, one step, the new weights out
        batch = make_batch(groups, args, trainer.ranks_sum)
        t_train = time.time()
        loss, stats = train_step(trainer, batch, args)
        t_train = time.time() - t_train
        eval_now = trainer.version % args.eval_every == 0 or trainer.version == args.steps
        sync_s, sync_bytes = source.publish(trainer, trainer.version == args.steps, eval_now)
        # ---- accounting, logging, alarms
        dt = time.time() - t0
        # every device; not the generators' evals
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
    path = os.path.join(args.out, f"curriculum-rank{env.ctx.rank}.json")
    pipeline.run_generator(env.ctx, args, env.model, env.tokenizer, env.train, env.train_ids,
                           env.state.get("step", 0), path, env.val, env.val_ids)
    pipeline.finish(env.ctx)


def summary(args, seconds):
    """Rank 0: the run's end in a few lines."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    evals = [r for _, r in read_jsonl(metrics_path) if r.get("kind") == "eval"]
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
    args = get_args()
    if not args.eval_only:  # an eval has nothing to save
        faults.stop_on_signals()
    # under torchrun the last --gen_ranks ranks serve rollouts
    entry = serve_rollouts if pipeline.generator_rank(args) else main
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
