"""
toy.py: the embedded default, the toy task and its 0.34M-parameter Llama; start at toy_task.

    python toy.py                     # the toy model's folder and a few toy problems
    python toy.py --build [toy-hard]  # remake a shipped base model from fixed seeds
"""

import functools
import itertools
import json
import os
import random
import shutil
import time

from data import INTERRUPT_PHRASE, format_prompt

HERE = os.path.dirname(os.path.abspath(__file__))
TOY_DIR = os.path.join(HERE, "toy_model")
TOY_DIRS = {"toy": TOY_DIR, "toy-hard": os.path.join(HERE, "toy_model_hard")}

# chain length, start, operand, largest total
PRESETS = {
    "toy": dict(ops=(1, 4), start=(1, 12), operand=(1, 3), top=20),
    # the study's task: a ceiling below 1
    "toy-hard": dict(ops=(2, 6), start=(1, 20), operand=(1, 5), top=30),
}


def toy_problem(rng, preset="toy"):
    """A start number and a chain of + / - operations."""
    cfg = PRESETS[preset]
    n_ops = rng.randint(*cfg["ops"])
    total = rng.randint(*cfg["start"])
    text, steps = str(total), []
    for _ in range(n_ops):
        d = rng.randint(*cfg["operand"])
        op = "-" if total - d >= 0 and (total + d > cfg["top"] or rng.random() < 0.5) else "+"
        new = total - d if op == "-" else total + d
        steps.append((total, op, d, new))
        text += f"{op}{d}"
        total = new
    return {"prompt": f"Compute {text}.", "answer": str(total), "steps": steps}


def toy_problems(n, seed, preset="toy"):
    rng = random.Random(seed)
    return [toy_problem(rng, preset) for _ in range(n)]


@functools.lru_cache(maxsize=4)
def toy_task(seed, preset="toy"):
    """A preset's distinct problems, cached: copy before changing."""
    seen = {}
    for p in toy_problems(4000, seed + 12345, preset):
        seen.setdefault(p["prompt"], dict(p, domain="math"))
    return tuple(seen.values())


def toy_trace(problem, rng):
    """A warm-up completion, its answer often wrong."""
    shown, total = [], None
    for a, op, d, _ in problem["steps"]:
        a = a if total is None else total
        total = a + d if op == "+" else a - d
        if rng.random() < 0.03:  # a slip, carried forward
            total += rng.choice([-2, -1, 1, 2])
        shown.append(f"{a}{op}{d}={total}")
    think = ",".join(shown) + "."
    if rng.random() < 0.2:  # long traces, to interrupt
        think += " Check:" + ",".join(shown) + "."
    answer = total
    if rng.random() < 0.7:  # room for RL to climb
        answer = rng.choice([problem["steps"][0][0], total + 1, total - 1,
                             total + rng.choice([-10, 10])])
    return f"<think>{think}</think> The answer is \\boxed{{{answer}}}."


def build_toy_model(out_dir=None, seed=0, sft_steps=3200, log=print, preset="toy"):
    """Train a preset's tokenizer and base model; save in HF layout."""
    out_dir = out_dir or TOY_DIRS[preset]
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    t0 = time.time()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    problems = toy_problems(20000, seed + 1, preset)
    texts = [format_prompt(None, p["prompt"]) + toy_trace(p, rng) for p in problems]
    # byte-level BPE: each number one token
    tok = Tokenizer(models.BPE())
    words = pre_tokenizers.Split(Regex(r" ?\d+| ?[A-Za-z]+|\s+|[^\sA-Za-z\d]"), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [words, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<think>", "</think>"],
                                  show_progress=False)
    tok.train_from_iterator(texts + [INTERRUPT_PHRASE] * 50, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    # Llama: Qwen2's tokenizer class would split digits
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.eos_token_id,
                         scalerl_task=preset)  # train.py's toy recipe
    model = LlamaForCausalLM(config)
    _warm_up(model, tokenizer, problems, texts, sft_steps, log)
    model.save_pretrained(out_dir + ".tmp")
    tokenizer.save_pretrained(out_dir + ".tmp")
    for name in ("config.json", "generation_config.json"):
        normalize_json(os.path.join(out_dir + ".tmp", name))
    if os.path.exists(out_dir):  # never a half-built folder
        os.replace(out_dir, out_dir + ".old")
    os.replace(out_dir + ".tmp", out_dir)
    shutil.rmtree(out_dir + ".old", ignore_errors=True)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"built toy base model ({n_params / 1e6:.2f}M params, vocab {len(tokenizer)}) "
        f"in {time.time() - t0:.0f}s -> {out_dir}")
    return out_dir


def normalize_json(path):
    """A rebuild leaves git clean."""
    with open(path) as f:
        config = json.load(f)
    config.pop("transformers_version", None)
    with open(path, "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _warm_up(model, tokenizer, problems, texts, steps, log, batch=16, lr=5e-3):
    """Supervised cold start."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    draws = [torch.randint(len(texts), (batch,), generator=g).tolist() for _ in range(steps)]
    drawn = sorted(set(itertools.chain(*draws)))
    enc = dict(zip(drawn, (ids + [tokenizer.eos_token_id]
                           for ids in tokenizer([texts[i] for i in drawn])["input_ids"])))
    prompts = [format_prompt(None, problems[i]["prompt"]) for i in drawn]
    n_prompt = dict(zip(drawn, map(len, tokenizer(prompts)["input_ids"])))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    for step, idx in enumerate(draws):
        T = max(len(enc[i]) for i in idx)
        ids = torch.full((batch, T), tokenizer.pad_token_id)
        labels = torch.full((batch, T), -100)
        for r, i in enumerate(idx):
            ids[r, :len(enc[i])] = torch.tensor(enc[i])
            labels[r, n_prompt[i]:len(enc[i])] = ids[r, n_prompt[i]:len(enc[i])]
        logits = model(input_ids=ids).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 30) * (1 - 0.9 * step / steps)
        opt.step()
        if step % 400 == 0 or step == steps - 1:
            log(f"  warm-up step {step}/{steps} | loss {loss.item():.3f}")
    model.eval()


def toy_model_dir(log=print, preset="toy"):
    """A preset's base model: shipped, or built on first use."""
    if os.path.exists(os.path.join(TOY_DIRS[preset], "config.json")):
        return TOY_DIRS[preset]
    cache = os.path.join(HERE, ".cache", os.path.basename(TOY_DIRS[preset]))
    if not os.path.exists(os.path.join(cache, "config.json")):
        log(f"{TOY_DIRS[preset]} is missing: building the {preset} base model "
            f"(3-6 minutes on 2 cores) -> {cache}")
        build_toy_model(cache, log=log, preset=preset)
    return cache


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(
        description="the embedded toy task and its model (see the docstring)", allow_abbrev=False)
    ap.add_argument("--build", nargs="?", const="toy", choices=list(PRESETS),
                    help="remake a shipped base model from fixed seeds "
                         "(toy: toy_model/, toy-hard: toy_model_hard/)")
    cli = ap.parse_args()
    if cli.build:
        build_toy_model(preset=cli.build)
    else:
        print(toy_model_dir())
        for p in toy_problems(3, 0):
            print(p["prompt"], "->", p["answer"])
