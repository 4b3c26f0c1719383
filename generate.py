"""
generate.py: the generator's custom KV-cache sampler (SCALERL.md section 3), and the trainer's
log-probs of the same tokens with the same float32 LM head (section 2, "FP32 LM head").

The sampler runs the decoder layers of a Hugging Face Llama / Qwen2 / Qwen3 / Mistral model with its own
preallocated KV cache: the model's own modules do the norms, projections, rotary embedding and MLP;
this file owns the cache, the attention call and the batching. What it adds over `model.generate`:
- continuous batching: `slots` rows decode together; a finished row's slot is refilled at once with
  the next prompt (its prompt is prefilled into that slot's cache), so the batch stays full. `sampler`
  is the sampler as a Python generator that the caller drives step by step, sending new prompts and
  taking finished samples (pipeline.py's generator ranks stream through it); `generate` runs one list
  of prompts through it;
- per-token records: the generator's log-prob of each sampled token under the sampling distribution
  (float32 LM head), a loss mask (0 on forced tokens), the policy version that produced each token,
  and the finish reason ("eos", "interrupted", "truncated");
- forced interruption: each sample gets a cut point drawn uniformly in the last ~1/6 of its thinking
  budget; if it is still thinking there, INTERRUPT_PHRASE (ending in </think>) is forced in token by
  token (mask 0), then the answer budget applies. Paper budgets: 12,288 thinking + 2,048 answer tokens
  (cut at 10k-12k); the toy defaults in train.py are 48 + 16;
- in-flight weight updates: between two steps the caller may copy new weights into the model in place
  and send the new policy version. The KV cache is kept (entries computed by the old weights stay),
  which is exactly PipelineRL's behaviour (section 4);
- sampling noise is a counter-based hash of (seed, sample key, position): one uniform per token, turned
  into a draw by the inverse CDF of softmax(logits / temperature), so a sample's result does not depend
  on which slot or batch it was decoded in; a few passes over the (batch, vocab) logits per step. Equal
  logits give equal tokens; logits that differ in the last bits (other kernels, thread counts) change a
  token when its uniform lies that close to a CDF boundary (odds ~ vocab x the difference per token).

Attention uses torch's scaled_dot_product_attention; on CUDA with flash-attn installed, its
flash_attn_with_kvcache kernel (same cache layout). Supported: model_type in SUPPORTED, full attention.
Reading chosen: the log-probs are of softmax(logits / temperature), the distribution actually
sampled; the trainer divides its logits by the same temperature. At temperature 0 (greedy) they are
plain log_softmax(logits).

    python generate.py                        # sample a few toy completions from the embedded model
    python generate.py --model DIR --prompt "What is 2+2?" --think_budget 512
"""

import argparse
import random
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:
    flash_attn_with_kvcache = None

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
INTERRUPT_PHRASE = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"


@dataclass
class Sample:
    key: int            # its noise key (generate: by default its prompt's index)
    tokens: list        # completion token ids, sampled and forced
    logps: list         # generator log-prob of each token (0.0 for forced tokens)
    mask: list          # 1 = sampled by the policy, 0 = forced (excluded from the loss)
    versions: list      # policy version that produced each token
    finish: str         # "eos" | "interrupted" | "truncated"


def check_supported(model):
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        raise ValueError(f"model_type '{cfg.model_type}' is not supported by the sampler; "
                         f"supported: {', '.join(SUPPORTED)}")
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        raise ValueError("sliding-window attention is not supported by the sampler (full attention only)")

# -----------------------------------------------------------------------------
# the forward pass with a preallocated cache


def new_cache(model, slots, max_len):
    """One (k, v) pair per layer, each (slots, max_len, n_kv_heads, head_dim) (flash-attn's layout)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    p = next(model.parameters())
    shape = (slots, max_len, cfg.num_key_value_heads, head_dim)
    return [(torch.zeros(shape, dtype=p.dtype, device=p.device), torch.zeros(shape, dtype=p.dtype, device=p.device))
            for _ in range(cfg.num_hidden_layers)]


def _attention(attn, x, cos, sin, cache, start, rows):
    """x (R, T, d): new tokens at positions start (R,) + 0..T-1; their k, v are written into the cache.
    rows None: a decode step of cache rows 0..R-1, attending to their cached keys (read as a view of the
    cache, never copied); rows (R,): a prefill of those rows from position 0, attending to the new keys."""
    R, T, _ = x.shape
    shape = (R, T, -1, attn.head_dim)
    q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over the head dim before the rotary embedding
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (R, H, T, D)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (R, T, H, D)
    k_cache, v_cache = cache
    idx = torch.arange(R, device=x.device) if rows is None else rows
    if flash_attn_with_kvcache is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=start.int(),
                                      cache_batch_idx=idx.int(), softmax_scale=attn.scaling, causal=True)
        return attn.o_proj(out.reshape(R, T, -1))
    pos = start[:, None] + torch.arange(T, device=x.device)  # (R, T) absolute positions
    k_cache[idx[:, None], pos] = k
    v_cache[idx[:, None], pos] = v
    if rows is not None:  # prefill: causal over the new keys; right padding comes after every real token
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=attn.scaling, enable_gqa=True)
    else:
        n_keys = int(pos.max()) + 1
        keys, values = k_cache[:R, :n_keys].transpose(1, 2), v_cache[:R, :n_keys].transpose(1, 2)  # (R, Hkv, S, D)
        mask = torch.arange(n_keys, device=x.device) <= pos[:, :, None]  # (R, T, S): causal, per-row length
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask[:, None],
                                             scale=attn.scaling, enable_gqa=True)  # (R, H, T, D)
    return attn.o_proj(out.transpose(1, 2).reshape(R, T, -1))


@torch.no_grad()
def forward(model, ids, start, cache, rows=None):
    """Run new tokens ids (R, T) from positions start (R,) -> hidden (R, T, d). rows None: cache rows
    0..R-1 continue (a decode step); rows (R,): a prefill of those cache rows, start all 0."""
    inner = model.model
    x = inner.embed_tokens(ids)
    position_ids = start[:, None] + torch.arange(ids.size(1), device=ids.device)
    cos, sin = inner.rotary_emb(x, position_ids)
    for layer, layer_cache in zip(inner.layers, cache):
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, layer_cache, start, rows)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return inner.norm(x)


def head_weight(model, fp32_head):
    """The LM head weight the logits are computed with: in at least float32 when fp32_head (SCALERL.md section 2)."""
    w = model.lm_head.weight
    return w.to(torch.promote_types(w.dtype, torch.float32)) if fp32_head else w


def logits_of(hidden, weight):
    """Logits in at least float32 for the softmax, whatever the weights' dtype."""
    return F.linear(hidden.to(weight.dtype), weight).to(torch.promote_types(weight.dtype, torch.float32))

# -----------------------------------------------------------------------------
# sampling: a pure function of (logits, temperature, counter-based noise)


def _mix(x):
    """splitmix64's finalizer on int64 tensors (wrapping arithmetic, logical shifts emulated)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9 as a signed int64
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * -7723592293110705685  # 0x94d049bb133111eb
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def uniform_noise(seed, keys, positions):
    """(B,) float64 uniforms in (0, 1), a deterministic function of (seed, key, position)."""
    x = _mix(_mix(keys * 1000003 + seed) + positions)  # (B,) int64
    return (((x >> 11) & ((1 << 53) - 1)).double() + 0.5) / (1 << 53)  # the top 53 bits


def sample(logits, temperature, seed, keys, positions):
    """logits (B, V) float32 -> (tokens (B,), log-probs (B,) of the sampling distribution).
    An inverse-CDF draw: the first token whose cumulative probability reaches the row's uniform. The CDF
    is summed in float64 (float32 would shift interval ends by ~sqrt(V) ulps: ~2e-5 at V = 152k)."""
    logp = (logits / temperature if temperature else logits).log_softmax(-1)
    if temperature == 0:
        tokens = logp.argmax(-1)
    else:
        cdf = logp.double().exp().cumsum(-1)  # (B, V)
        u = uniform_noise(seed, keys, positions) * cdf[:, -1]  # (B,): scaled to the row's total mass
        tokens = torch.searchsorted(cdf, u[:, None]).squeeze(-1).clamp_max(logits.size(-1) - 1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


# -----------------------------------------------------------------------------
# the continuous-batching loop


def cut_point(seed, key, think_budget):
    """The interruption point of one sample: uniform over the last ~1/6 of the thinking budget."""
    return random.Random(f"{seed}-{key}").randint(think_budget - think_budget // 6, think_budget)


@torch.no_grad()
def sampler(model, *, eos_id, think_end, interrupt_ids, think_budget, answer_budget, max_prompt_len,
            interrupt=True, slots=64, temperature=1.0, fp32_head=True, seed=0, version=0):
    """The continuous-batching sampler as a Python generator, driven by the caller one step at a time:

        steps = sampler(model, ...)
        finished, n_free = next(steps)                  # nothing has run yet: ([], slots)
        finished, n_free = steps.send((new, version))   # one step

    new: prompts to queue, [(prompt ids, noise key, tag)]; version: the policy version now in the
    model's weights (the caller may copy new weights in between two steps; the cache stays). A step
    prefills queued prompts into free slots, samples one token in every running slot, and yields the
    samples that finished, [(tag, Sample)], and how many slots are free for more prompts. With nothing
    running or queued it yields ([], slots) at once. Without interruption (interrupt=False) a sample is
    simply cut at think_budget + answer_budget tokens. think_end: the token ids of "</think>".
    max_prompt_len sizes the cache; a longer prompt is an error.
    """
    check_supported(model)
    device = next(model.parameters()).device
    max_new = think_budget + answer_budget + (len(interrupt_ids) if interrupt else 0)
    cache = new_cache(model, slots, max_prompt_len + max_new)
    weight = head_weight(model, fp32_head).detach()
    pending = deque()  # (prompt ids, key, tag) waiting for a slot
    state = [None] * slots  # per slot: dict of the sample in progress, or None when free
    finished = []
    while True:
        new, new_version = yield finished, sum(st is None for st in state) - len(pending)
        finished = []
        for p, key, tag in new:
            if len(p) > max_prompt_len:
                raise ValueError(f"prompt of {len(p)} tokens > max_prompt_len {max_prompt_len}")
            pending.append((p, key, tag))
        if new_version != version:  # in-flight update: weights changed, the cache stays
            version, weight = new_version, head_weight(model, fp32_head).detach()
        if not pending and not any(state):
            continue
        logits = torch.empty(slots, weight.size(0), device=device, dtype=torch.promote_types(weight.dtype, torch.float32))
        running = [s for s in range(slots) if state[s] is not None]
        if running:  # one decode step over slots 0..hi-1: free ones among them decode a dummy token at 0
            hi = running[-1] + 1  # (their cache is rewritten when a prompt is admitted, their logits unused)
            last = torch.tensor([state[s]["tokens"][-1] if state[s] else 0 for s in range(hi)], device=device)
            start = torch.tensor([state[s]["pos"] if state[s] else 0 for s in range(hi)], device=device)
            logits[:hi] = logits_of(forward(model, last[:, None], start, cache)[:, -1], weight)
        admitted = _admit(model, pending, state, cache, logits, weight, seed, think_budget)
        active = running + admitted
        key_t = torch.tensor([state[s]["key"] for s in active], device=device)
        pos_t = torch.tensor([len(state[s]["tokens"]) for s in active], device=device)
        tokens, logps = sample(logits[active], temperature, seed, key_t, pos_t)
        for s, tok, lp in zip(active, tokens.tolist(), logps.tolist()):
            done = _append(state[s], tok, lp, version, eos_id, think_end, interrupt_ids,
                           think_budget, answer_budget, interrupt)
            if done:
                st, state[s] = state[s], None
                finished.append((st["tag"], Sample(st["key"], st["tokens"], st["logps"], st["mask"], st["versions"], done)))


def generate(model, prompts, *, keys=None, slots=64, version=0, **settings):
    """Sample one completion per prompt (lists of token ids) -> list of Sample, in prompt order.
    keys: per-prompt noise keys (default 0..n-1): equal keys and seed give equal draws, whatever the
    batching. settings: the sampler's (eos_id, think_end, interrupt_ids, the budgets, ...)."""
    keys = range(len(prompts)) if keys is None else keys
    results = [None] * len(prompts)
    steps = sampler(model, slots=min(slots, len(prompts)), max_prompt_len=max(map(len, prompts), default=1),
                    version=version, **settings)
    next(steps)
    new, left = list(zip(prompts, keys, range(len(prompts)))), len(prompts)
    while left:
        finished, _ = steps.send((new, version))
        new, left = [], left - len(finished)
        for i, s in finished:
            results[i] = s
    return results


def _admit(model, pending, state, cache, logits, weight, seed, think_budget):
    """Prefill the next queued prompts into free slots; their next-token logits go into `logits`."""
    free = [s for s in range(len(state)) if state[s] is None][:len(pending)]
    if not free:
        return []
    device = logits.device
    items = [pending.popleft() for _ in free]
    lens = [len(p) for p, _, _ in items]
    ids = torch.zeros(len(free), max(lens), dtype=torch.long, device=device)
    for r, (p, _, _) in enumerate(items):
        ids[r, :lens[r]] = torch.tensor(p, device=device)
    start = torch.zeros(len(free), dtype=torch.long, device=device)
    hidden = forward(model, ids, start, cache, rows=torch.tensor(free, device=device))  # right padding: never attended
    last = hidden[torch.arange(len(free), device=device), torch.tensor(lens, device=device) - 1]
    logits[free] = logits_of(last, weight)
    for s, (p, key, tag), n in zip(free, items, lens):
        state[s] = {"key": key, "tag": tag, "pos": n, "tokens": [], "logps": [], "mask": [], "versions": [],
                    "forced": [], "thinking": True, "answer_start": None, "interrupted": False,
                    "cut": cut_point(seed, key, think_budget)}
    return free


def _append(st, tok, logp, version, eos_id, think_end, interrupt_ids, think_budget, answer_budget, interrupt):
    """Add the next token to a sample (sampled, or forced when a forced phrase is pending).
    Returns the finish reason when the sample is complete, else None."""
    if st["tokens"]:
        st["pos"] += 1  # the previous token is now in the cache
    n = len(st["tokens"])
    if interrupt and st["thinking"] and not st["forced"] and n == st["cut"]:
        st["forced"], st["interrupted"] = list(interrupt_ids), True
    forced = bool(st["forced"])
    if forced:
        tok, logp = st["forced"].pop(0), 0.0
    st["tokens"].append(tok)
    st["logps"].append(logp)
    st["mask"].append(0 if forced else 1)
    st["versions"].append(version)
    if st["forced"]:
        return None  # the rest of the phrase is still to come
    if tok == eos_id:
        return "interrupted" if st["interrupted"] else "eos"
    if st["thinking"] and (forced or st["tokens"][-len(think_end):] == think_end):  # the phrase ends the thought
        st["thinking"], st["answer_start"] = False, n + 1
    limit = think_budget + answer_budget if not interrupt or st["thinking"] else st["answer_start"] + answer_budget
    return "truncated" if len(st["tokens"]) >= limit else None

# -----------------------------------------------------------------------------
# the trainer's side: log-probs of given tokens, float32 head, in chunks


def _chunk_logprobs(hidden, weight, targets, temperature):
    logits = logits_of(hidden, weight)  # (N, t, V) float32, one chunk at a time
    if temperature:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)


def sequence_logprobs(model, ids, attention_mask, fp32_head=True, temperature=1.0, chunk=128):
    """log p(ids[:, t+1] | ids[:, :t+1]) for every t -> (N, T-1), with grad.

    The (N, chunk, V) float32 logits of one chunk exist at a time, in the forward and (recomputed
    by activation checkpointing) in the backward, so memory is O(N x chunk x V), not O(N x T x V).
    """
    hidden = model.model(input_ids=ids, attention_mask=attention_mask).last_hidden_state[:, :-1]  # (N, T-1, d)
    weight = head_weight(model, fp32_head)  # with grad: the cast is part of the graph
    targets = ids[:, 1:]
    parts = [checkpoint(_chunk_logprobs, hidden[:, a:a + chunk], weight, targets[:, a:a + chunk], temperature,
                        use_reentrant=False) for a in range(0, hidden.size(1), chunk)]
    return torch.cat(parts, 1)


if __name__ == "__main__":
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from data import format_prompt, toy_model_dir, toy_problems

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="HF model folder; empty = the embedded toy model")
    ap.add_argument("--prompt", default="", help="a problem; empty = three toy problems")
    ap.add_argument("--think_budget", type=int, default=48)
    ap.add_argument("--answer_budget", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    path = args.model or toy_model_dir()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    problems = [args.prompt] if args.prompt else [p["prompt"] for p in toy_problems(3, 0)]
    prompts = [tokenizer(format_prompt(tokenizer, p))["input_ids"] for p in problems]
    out = generate(model, prompts, eos_id=tokenizer.eos_token_id,
                   think_end=tokenizer("</think>", add_special_tokens=False)["input_ids"],
                   interrupt_ids=tokenizer(INTERRUPT_PHRASE, add_special_tokens=False)["input_ids"],
                   think_budget=args.think_budget, answer_budget=args.answer_budget, temperature=args.temperature)
    for p, s in zip(problems, out):
        print(f"{p!r} -> [{s.finish}] {tokenizer.decode(s.tokens)!r}")
