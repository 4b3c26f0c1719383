"""
config.py: every flag of train.py, each with its default and a short help, and the recipes
(RECIPES) that size a run: `paper` is appendix A.3's (48 prompts x 16 samples, 12,288 + 2,048
tokens, lr 5e-7); `toy` and `one_gpu` depart from it in their sizes, and the toy also in
--neg_trust 0.5 and --grad_clip 1 (README, "Recipes"). Every other default is ScaleRL's choice
(section 4). Start at `get_args`.

A flag given overrides its recipe value: the recipe's flags default to None, and `apply_recipe`
(--recipe auto: toy for the embedded models, paper for any other) fills only those left None.
The start-up prints the values in force and each flag that differs (`recipe_lines`).

    python train.py --help                    # every flag, and each recipe's value of it
"""

import argparse
import difflib
import itertools
import os
import re

import faults
from runs import read_json
from toy import PRESETS

# -----------------------------------------------------------------------------
# flags: ScaleRL's choices by default

LENGTH_CONTROLS = ("interrupt", "penalty", "none")
# loss.py's names, spelt here: the flags are parsed before torch loads (a test holds them equal)
LOSS_KINDS, AGGS, NORMS = ("cispo", "grpo", "dapo", "gspo"), ("prompt", "sample", "token"), \
    ("batch", "prompt", "none")

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

# --method: the recipes the paper's Figure 2 compares with ScaleRL (section 5), each of the flags
# below alone, over any --recipe's sizes; a flag given overrides (README, "Methods")
METHODS = {
    "scalerl": {},  # section 4: every default
    # DeepSeekMath's GRPO (arXiv 2402.03300) with PPO-off-policy, without its KL term
    "grpo": dict(loss="grpo", agg="sample", adv_norm="prompt", zero_var_filter=False,
                 no_positive_resampling=False, length_control="none", keep_truncated=True,
                 fp32_head=False, mode="ppo_offpolicy"),
    # DAPO (arXiv 2503.14476): clip-higher, token average, dynamic sampling, overlong penalty
    "dapo": dict(loss="dapo", agg="token", adv_norm="prompt", zero_var_filter=True,
                 no_positive_resampling=False, length_control="penalty", fp32_head=False,
                 mode="ppo_offpolicy"),
    # Magistral (arXiv 2506.10910): clip-higher, the group's length as divisor, minibatch
    # advantage normalization, zero-advantage groups dropped, a length penalty
    "magistral": dict(loss="dapo", agg="prompt", adv_norm="batch", zero_var_filter=True,
                      no_positive_resampling=False, length_control="penalty", fp32_head=False,
                      mode="ppo_offpolicy"),
    # MiniMax-M1 (arXiv 2506.13585): CISPO, token average, the group's normalization, FP32 head
    "minimax": dict(loss="cispo", agg="token", adv_norm="prompt", zero_var_filter=False,
                    no_positive_resampling=False, length_control="none", fp32_head=True,
                    mode="ppo_offpolicy"),
}


class FlagParser(argparse.ArgumentParser):
    """argparse: one-line errors, no abbreviations."""

    def __init__(self, **kw):
        super().__init__(allow_abbrev=False, **{"formatter_class": RecipeHelpFormatter, **kw})

    def error(self, message):
        flags = [o for a in self._actions for o in a.option_strings]
        faults.say_error(f"{self.prog}: error: {message}{did_you_mean(message, flags)} "
                         "(--help lists the flags)")  # under torchrun: once
        self.exit(2)


def did_you_mean(message, flags):
    """argparse's message -> " (--x: did you mean --y?)" for each mistyped flag in it, or ""."""
    typed = (re.findall(r"(--[\w-]+)", message)
             if message.startswith("unrecognized arguments") else [])
    return "".join(f" ({t}: did you mean {close}?)" for t in typed
                   if (close := closest_flag(t, flags)))


def closest_flag(typed, flags):
    """The flag a mistyped one most likely meant, or None: the flags sharing the most leading
    words (--temp, --temperature), then difflib. Spelling alone would take --lr_rate for
    --l_cache, not --lr."""
    def words(flag):
        return re.split(r"[-_]+", flag.lstrip("-"))

    def kinship(flag):  # (equal leading words, whether the next two begin one another)
        pairs = list(zip(words(typed), words(flag)))
        n = len(list(itertools.takewhile(lambda ab: ab[0] == ab[1], pairs)))
        a, b = sorted(pairs[n], key=len) if n < len(pairs) else ("", "")
        return n, len(a) >= 3 and b.startswith(a)  # 3 letters at least: "l" begins too much

    best = max(map(kinship, flags), default=(0, False))
    pool = [f for f in flags if kinship(f) == best] if any(best) else flags
    close = difflib.get_close_matches(typed, pool, 1, cutoff=0.0 if any(best) else 0.6)
    return close[0] if close else None


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
                   help="held-out problems: split from --data (toy: 200, or a tenth of a --data of "
                        "fewer than 2,000 problems), or the first of --val_data (default: all)")
    g.add_argument("--out", default=None,
                   help="output folder: metrics.jsonl and checkpoints; None = runs/ and the run's "
                        "--model, data and recipe (but the toy's), and under torchrun its ranks, "
                        "mode and --fsdp (runs/toy, runs/toy-2ranks, runs/toy-one_gpu, "
                        "runs/Qwen3-0.6B-gsm8k-paper-8ranks-fsdp, ...)")
    g.add_argument("--device", default="auto", help="auto = cuda when available, else cpu")
    g.add_argument("--recipe", default="auto", choices=["auto", *RECIPES],
                   help="the sizes and rates to start from (RECIPES; a flag given overrides its "
                        "value, and the start-up line names each one that differs): auto = toy "
                        "for the embedded tasks, paper for any --model")
    g.add_argument("--method", default="scalerl", choices=list(METHODS),
                   help="the RL recipe (METHODS: the ones the paper's Figure 2 compares), set by "
                        "flags of this list alone over --recipe's sizes; a flag given overrides "
                        "its value: scalerl = the defaults; grpo = --loss grpo --agg sample "
                        "--adv_norm prompt ...; dapo, magistral, minimax (README, \"Methods\")")
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
    g.add_argument("--loss", default="cispo", choices=LOSS_KINDS,
                   help="policy loss: CISPO is ScaleRL's; the others are ablations (loss.py) "
                        "that change the objective alone: --loss grpo alone keeps ScaleRL's "
                        "--agg prompt --adv_norm batch, where the paper's GRPO is --agg sample "
                        "--adv_norm prompt (--method grpo)")
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
                   help="never resample a prompt once its historical pass rate (every group of "
                        "it so far) reaches 0.9")


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
    g.add_argument("--gen_ranks", type=count_or_fraction, default=0,
                   help="generator ranks: a count, or a fraction of the ranks (0.8: 64 "
                        "generators + 16 trainers of 80, the paper's split); 0 = world - max(1, "
                        "world // 4)")
    g.add_argument("--timeout", type=float, default=1800,
                   help="seconds any cross-rank wait may last")
    g.add_argument("--heartbeat_timeout", type=float, default=60,
                   help="seconds of silence before a rank is declared dead")
    g.add_argument("--bucket_mb", type=int, default=256, help="weight broadcast bucket size")
    g.add_argument("--fsdp", action="store_true",
                   help="shard the trainers' model and optimizer state over the trainer ranks "
                        "(FSDP2); no trainer keeps a whole copy, and checkpoints keep the float32 "
                        "shards and AdamW state sharded")


def count_or_fraction(text):
    """--gen_ranks' value: a whole count, or a fraction in (0, 1)."""
    value = float(text)
    if not (value.is_integer() or 0 < value < 1):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count nor a fraction in (0, 1)")
    return int(value) if value.is_integer() else value


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


def parse_first(parser):
    """A script's flags parsed before its heavy imports (torch and transformers take seconds):
    --help and a mistyped flag answered at once, and a start says so at once (rank 0)."""
    parser.parse_args()
    if int(os.environ.get("RANK", "0")) == 0:
        print("starting: importing torch and transformers ...", flush=True)


def get_args(argv=None):
    """train.py's flags, parsed and checked (checks.py) -> args."""
    from checks import check_args, check_model_dir  # imports torch: after parse_first
    ap = make_parser()
    args = ap.parse_args(argv)
    apply_method(args, ap, argv)
    # --resume compares args.model as typed
    args.model_dir = check_model_dir(args.model, ap.error)
    apply_recipe(args)
    args.out = args.out or default_out(args)
    check_args(args, ap.error)
    return args


def default_out(args):
    """runs/ and what tells the run apart: its --model, data and recipe (but the toy's), and under
    torchrun its shape: runs/toy, runs/toy-one_gpu, runs/Qwen3-0.6B-gsm8k-paper-8ranks-fsdp."""
    name = "+".join(os.path.splitext(os.path.basename(p.split(":")[0].rstrip("/")))[0] or p
                    for p in (args.data or "toy").split(","))
    model = os.path.basename(args.model.rstrip("/"))  # a Hub id's name, a folder's
    name = (f"{model}-" if model else "") + name + \
        ("" if args.recipe == "toy" else f"-{args.recipe}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        name += f"-{world}ranks" + ("" if args.mode == "pipeline" else f"-{args.mode}") + \
            ("-fsdp" if args.fsdp else "")
    return os.path.join("runs", name)


def apply_method(args, ap, argv):
    """--method: its flags' values, where that flag was not given."""
    for action in ap._actions:  # parsed again without defaults: what was given
        action.default = argparse.SUPPRESS
    given = vars(ap.parse_args(argv))
    for name, value in METHODS[args.method].items():
        if name not in given:
            setattr(args, name, value)


def apply_recipe(args):
    """--recipe auto: toy for the embedded models, else paper; fill the flags not given."""
    if args.recipe == "auto":
        task = ""
        if args.model_dir and os.path.isfile(os.path.join(args.model_dir, "config.json")):
            task = read_json(os.path.join(args.model_dir, "config.json")).get("scalerl_task", "")
        args.recipe = "toy" if not args.model_dir or task in PRESETS else "paper"
    for name, value in recipe_defaults(args).items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def recipe_defaults(args):
    """The values --recipe gives this run: its --val_size sizes a split of --data, and a --val_data
    file is held out whole unless --val_size is given."""
    return RECIPES[args.recipe] | ({"val_size": None} if args.val_data else {})


# -----------------------------------------------------------------------------
# start-up lines


def recipe_values(args, n_val):
    """The recipe's values in force, on one line."""
    clip = f"grad clip {args.grad_clip:g}" if args.grad_clip else "no grad clip"
    mask = f"--neg_trust {args.neg_trust:g}" if args.neg_trust else "no CISPO mask"
    return (f"{args.prompts} prompts x {args.samples} samples | think {args.think_budget} + answer "
            f"{args.answer_budget} tokens | {args.steps} steps, lr {args.lr:g}, warm-up "
            f"{args.warmup}, {clip}, {mask} | eval every {args.eval_every} on {n_val} held-out x "
            f"{args.eval_samples} | save every "
            f"{args.save_every} | {args.dtype}")


def recipe_lines(args, n_val):
    """Rank 0's first start-up lines: the recipe's values in force, then each flag that differs."""
    defaults = vars(make_parser().parse_args([])) | recipe_defaults(args) | METHODS[args.method]
    flag = lambda k, v: f"--{k}" if v is True else f"--no-{k}" if v is False else f"--{k} {v}"
    given = [flag(k, getattr(args, k)) for k, v in defaults.items()
             if k not in ("recipe", "method", "out") and getattr(args, k) != v]
    method = "" if args.method == "scalerl" else f", method {args.method}"
    return [f"recipe {args.recipe}{method}: " + recipe_values(args, n_val),
            f"flags that differ from it and the defaults: {' '.join(given) or 'none'}"]


def sample_parser(description):
    """generate.py's flags: a few samples from a model folder."""
    ap = FlagParser(prog="generate.py", description=description,
                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="", help="HF model folder, e.g. a checkpoint "
                    "runs/toy/ckpt-000150, or a Hugging Face Hub id (Qwen/Qwen3-0.6B: downloaded "
                    "once into the Hugging Face cache); empty = the embedded toy model")
    ap.add_argument("--prompt", default="", help="a problem; empty = three toy problems")
    ap.add_argument("--n", type=int, default=1, help="samples per problem")
    ap.add_argument("--seed", type=int, default=0, help="sampling noise seed")
    ap.add_argument("--think_budget", type=int, default=48,
                    help="thinking tokens before the interruption")
    ap.add_argument("--answer_budget", type=int, default=64, help="answer tokens after </think>")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    return ap
