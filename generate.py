"""
generate.py: the generator's custom KV-cache sampler (arXiv 2510.13786, section 3.1), and the
trainer's log-probs of the same tokens with the same float32 LM head (section 3.2, the FP32
precision of the LM head).

The sampler runs the decoder layers of a Hugging Face Llama / Qwen2 / Qwen3 / Mistral model with its
own preallocated KV cache: the model's own weights and modules (projections, MLP, rotary
frequencies, the projections called as functions), the norms and rotary embedding in fewer ops (the
same arithmetic); this file owns the cache, the attention call, the sampling and the batching. What
it adds over `model.generate`:
- continuous batching: `slots` rows decode together; a finished row's slot is refilled with the next
  prompt (its prompt is prefilled into that slot's cache, in forwards of at most PREFILL_TOKENS
  padded tokens), so the batch stays full. `sampler` is the sampler as a Python generator that the
  caller drives, sending new prompts and taking finished samples (pipeline.py's generator ranks
  stream through it); `generate` runs one list of prompts;
- a KV cache taken in blocks of BLOCK tokens as rows grow (vLLM's paged cache), sized by memory on
  CUDA (fit_slots: rows at their mean length); a prompt waits for its blocks, and when the pool runs
  out the newest rows restart from their prompts (the same noise key: the same sample);
- a decode step with static shapes (class Decoder): every slot's bookkeeping (position, budgets,
  interruption point, forced phrase, eos and </think> detection, finish reason) lives in device
  tensors, so a step needs no per-slot Python and no host sync; on CUDA each step size is captured
  once as a CUDA graph and replayed. Finished rows are collected every `sync_every` steps;
- per-token records: the generator's log-prob of each sampled token under the sampling distribution
  (float32 LM head), a loss mask (0 on forced tokens), the policy version that produced each token,
  and the finish reason ("eos", "interrupted", "truncated"); any of the model's eos ids ends a
  sample (Qwen2.5/3 instruct and Llama-3 list several);
- forced interruption: each sample gets a cut point drawn uniformly in the last ~1/6 of its thinking
  budget; if it is still thinking there, the interruption phrase (the caller's interrupt_ids: the
  tokens of data.INTERRUPT_PHRASE, ending in </think>) is forced in token by token (mask 0), then
  the answer budget applies. Paper budgets: 12,288 thinking + 2,048 answer tokens (cut at 10k-12k);
  the toy defaults in train.py are 48 + 64 (the answer budget well beyond the toy answer's 11
  tokens, as the paper's 2,048 is well beyond its answers: a change of format is scored, not
  truncated);
- in-flight weight updates: between two sends the caller may copy new weights into the model in
  place and send the new policy version. The KV cache is kept (entries computed by the old weights
  stay), which is exactly PipelineRL's behaviour (paper section 3.1);
- sampling noise is a counter-based hash of (seed, sample key, position): one uniform per token (a
  sample's uniforms are hashed when it is admitted, a row of a table that the step reads), turned
  into a draw by a two-level float64 inverse CDF of softmax(logits / temperature), so a sample's
  result does not depend on which slot or batch it was decoded in. Equal logits give equal tokens;
  logits that differ in the last bits (other kernels, batch sizes, thread counts) change a token
  when its uniform lies that close to a CDF boundary (odds ~ vocab x the difference per token).

A decode step's attention reads each row's own keys (decode_kernel): flash-attn's
flash_attn_with_kvcache or torch's varlen_attn on CUDA, where they run; off CUDA, rows grouped by
length bucket, each group over its own keys (SDPA); on CUDA without either, every row over the
longest row's bucket. The q/k/v projections run as one GEMM (fused_qkv). Supported:
model_type in SUPPORTED, full attention. Reading chosen: the log-probs are of softmax(logits /
temperature), the distribution actually sampled; the trainer divides its logits by the same
temperature. At temperature 0 (greedy) they are plain log_softmax(logits).

The trainer's forward (packed_logprobs) is the model's own decoder layers on samples packed into one
row, attention within each sample (a varlen flash kernel on CUDA, each sample's SDPA elsewhere), no
KV cache, each layer checkpointed above CHECKPOINT_ABOVE layers (it keeps its input alone: 2 KB per
token at Qwen3-0.6B's width, against 72 KB), then the final norm, float32 head and log-softmax in
chunks of at most LOGITS_BYTES of logits.

    python generate.py                        # sample a few toy completions from the embedded model
    python generate.py --model runs/toy/ckpt-000150 --n 4 --seed 1    # from what you trained
    python generate.py --model DIR --prompt "What is 2+2?" --think_budget 512
    python generate.py --model Qwen/Qwen3-0.6B --prompt "What is 2+2?" --think_budget 512
                                              # a Hub id: downloaded once, cached
"""

import argparse
import inspect
import random
import sys
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

try:  # decode attention over each row's own length on CUDA (decode_kernel picks one that runs)
    from flash_attn import flash_attn_with_kvcache
except Exception:  # not installed, or built for another torch
    flash_attn_with_kvcache = None
try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
FINISH = ("eos", "interrupted", "truncated")  # a slot's finish code c > 0 means FINISH[c - 1]
CPU_SLOTS = 128  # the sampler's rows off CUDA, where memory does not size them (fit_slots)
PREFILL_TOKENS = 8192  # padded prompt tokens per prefill forward (one prompt at least)
BLOCK = 256  # KV-cache tokens per block (flash-attn's paged-KV page size)


@dataclass
class Sample:
    key: int            # its noise key (generate: by default its prompt's index)
    tokens: list        # completion token ids, sampled and forced
    logps: list         # generator log-prob of each token (0.0 for forced tokens)
    mask: list          # 1 = sampled by the policy, 0 = forced (excluded from the loss)
    versions: list      # policy version that produced each token
    finish: str         # "eos" | "interrupted" | "truncated"


# a model config's sizes (whole numbers >= 1) and rope parameters (numbers > 0), where present
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")
ROPE = ("rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
        "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "partial_rotary_factor")


def config_problem(cfg):
    """What in a model config (a dict: config.json) the sampler cannot run -> 'FIELD is ...', or
    None: a size not a whole number >= 1, a rope parameter not a finite number > 0 (rope_theta 0
    made the rotary tables NaN), a bos/eos id outside the vocabulary."""
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    for k in SIZES:
        if cfg.get(k) is not None and not (whole(cfg[k]) and cfg[k] >= 1):
            return f"{k} is {cfg[k]!r}, not a whole number >= 1"
    heads = cfg.get("num_attention_heads") or 1
    kv = cfg.get("num_key_value_heads") or heads
    if heads % kv:
        return f"num_key_value_heads {kv} does not divide num_attention_heads {heads}"
    nested = [(f"{d}.", cfg[d]) for d in ("rope_parameters", "rope_scaling")
              if isinstance(cfg.get(d), dict)]
    for prefix, d in [("", cfg)] + nested:
        for k in ROPE:
            v = d.get(k)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and 0 < v < float("inf")):
                return f"{prefix}{k} is {v!r}, not a finite number > 0"
    for k in ("bos_token_id", "eos_token_id"):
        ids = cfg.get(k) if isinstance(cfg.get(k), list) else [cfg.get(k)]
        vocab = cfg.get("vocab_size") or float("inf")
        if any(i is not None and not (whole(i) and 0 <= i < vocab) for i in ids):
            return f"{k} is {cfg.get(k)!r}, not an id below vocab_size {vocab}"
    return None


def check_supported(model):
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        raise ValueError(f"model_type '{cfg.model_type}' is not supported by the sampler; "
                         f"supported: {', '.join(SUPPORTED)}")
    problem = config_problem(cfg.to_dict())
    if problem:
        raise ValueError(f"config.json: {problem}")
    if (getattr(cfg, "use_sliding_window", False)
            or "sliding_attention" in (getattr(cfg, "layer_types", None) or [])):
        raise ValueError("sliding-window attention is not supported by the sampler "
                         "(full attention only)")
    rope = model.model.rotary_emb.rope_type
    if "dynamic" in rope or rope == "longrope":  # their frequencies change with the sequence length
        raise ValueError(f"rope_type '{rope}' is not supported by the sampler "
                         "(its rotary tables are fixed)")

# -----------------------------------------------------------------------------
# the forward pass with a preallocated cache


def head_dim_of(config):
    """The attention head size: the config's head_dim (Qwen3), else hidden_size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def new_cache(model, blocks, block=BLOCK):
    """One (k, v) pair per layer, each a pool (blocks, block, n_kv_heads, head_dim) (flash-attn's
    paged layout): token t of a row lives at table[row, t // block] * block + t % block."""
    cfg = model.config
    p = next(model.parameters())
    shape = (blocks, block, cfg.num_key_value_heads, head_dim_of(cfg))
    return [(torch.zeros(shape, dtype=p.dtype, device=p.device),
             torch.zeros(shape, dtype=p.dtype, device=p.device))
            for _ in range(cfg.num_hidden_layers)]


def fused_qkv(model, into=None):
    """Per layer the q, k and v projections' weights and biases concatenated (one GEMM instead of
    three), and Qwen3's q and k norm weights as one (H + Hkv, D) weight (one norm for both): copies,
    made once and refreshed in place (into) after new weights -> [(w, b or None, norm or None)]."""
    out = []
    for layer in model.model.layers:
        a = layer.self_attn
        w = torch.cat([m.weight for m in (a.q_proj, a.k_proj, a.v_proj)]).detach()
        b = (None if a.q_proj.bias is None else
             torch.cat([m.bias for m in (a.q_proj, a.k_proj, a.v_proj)]).detach())
        norm = None
        if hasattr(a, "q_norm"):
            H, Hkv = (m.out_features // a.head_dim for m in (a.q_proj, a.k_proj))
            norm = torch.cat([a.q_norm.weight.expand(H, -1), a.k_norm.weight.expand(Hkv, -1)])
        out.append((w, b, None if norm is None else norm.detach()))
    if into is not None:
        for new, old in zip(out, into):
            for t, o in zip(new, old):
                if t is not None:
                    o.copy_(t)
    return out


def rope_tables(model, n):
    """The rotary embedding's cos and signed sin (n, D) of positions 0..n-1, from the model's own
    rotary module, made once: a step looks its rows' positions up (the same values as the module
    gives per position). The sin's first half is negated for _rope."""
    p = next(model.parameters())
    cos, sin = model.model.rotary_emb(p[:0],
                                      torch.arange(n, device=p.device)[None])  # (1, n, D) each
    half = cos.size(-1) // 2
    return cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)


def _linear(module, x):
    """A projection with the module's own weight and bias, called as a function: in a decode step of
    a small model, a module call's overhead is a sizeable part of the step."""
    return F.linear(x, module.weight, module.bias)


def _norm(module, x):
    """A decoder RMSNorm as the model computes it (float32 statistics, the weight applied in the
    model's dtype), in 2-4 ops instead of its module's 8: the step's op count is what a decode step
    costs."""
    return module.weight * F.rms_norm(x.float(), x.shape[-1:],
                                      eps=module.variance_epsilon).to(x.dtype)


def _rope(x, cos, sin_signed):
    """The rotary embedding of x (R, T, H, D): x cos + rotate_half(x) sin, where rotate_half(x) sin
    equals roll(x, D/2) times sin with its first half negated (sin_signed): the same products and
    sum as the model's, bit for bit. (A fused addcmul rounds once less, and in bf16 that moved the
    toy's generator/trainer log-prob agreement from 1e-5 to 8e-3 mean.)"""
    return x * cos + x.roll(x.size(-1) // 2, -1) * sin_signed


def _keys(attn, x, cos, sin, cache, at, qkv, keys_only=False):
    """Project x (R, T, d) with the fused weights qkv, rotary-embed, and write the keys and values
    in place at flat cache positions `at` (R * T,) (forward) -> q, k, v
    (R, T, heads, D); q None with keys_only (a prefill's last layer)."""
    w, b, norm = qkv
    D, Hkv = attn.head_dim, cache[0].size(2)
    H = 0 if keys_only else w.size(0) // D - 2 * Hkv
    if keys_only:
        w, b = w[-2 * Hkv * D:], None if b is None else b[-2 * Hkv * D:]
    y = F.linear(x, w, b).view(*x.shape[:2], -1, D)  # (R, T, H + 2 Hkv, D)
    qk, v = y[:, :, :H + Hkv], y[:, :, H + Hkv:]
    if norm is not None:  # Qwen3: RMSNorm over the head dim before the rotary embedding, as _norm
        qk = norm[-(H + Hkv):] * F.rms_norm(qk.float(), (D,),
                                            eps=attn.k_norm.variance_epsilon).to(qk.dtype)
    q, k = _rope(qk, cos, sin).split([H, Hkv], 2)  # one rotary embedding for queries and keys
    for c, t in zip(cache, (k, v)):
        c.view(-1, Hkv, D).index_copy_(0, at, t.reshape(-1, Hkv, D))
    return (None if keys_only else q), k, v


def _attention(attn, x, cos, sin, cache, at, qkv, how):
    """x (R, T, d): new tokens written at flat cache positions `at`. how None: a prefill from
    position 0, attending causally to the new keys alone; else a decode step (T = 1) of cache rows
    0..R-1, each over its own keys (_decode)."""
    R, T, _ = x.shape
    q, k, v = _keys(attn, x, cos, sin, cache, at, qkv)
    if how is None:  # prefill: causal over the new keys; right padding comes after every real token
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True, scale=attn.scaling,
                                             enable_gqa=True)  # (R, H, T, D)
        return _linear(attn.o_proj, out.transpose(1, 2).reshape(R, T, -1))
    return _linear(attn.o_proj, _decode(q, *cache, attn.scaling, how).reshape(R, 1, -1))


def _decode(q, k_cache, v_cache, scale, how):
    """Decode attention of q (R, 1, H, D) over rows 0..R-1 of the block pools k_cache, v_cache ->
    (R, H, D). how: ("flash", lens, table) or ("varlen", lens, table, 0..R): a kernel that reads
    each row's own lens (R,) keys through its block table (R, W); ("masked", mask (R, 1, 1, S),
    at (R, S)): every row over its first S keys (flat positions at), later ones masked;
    ("groups", [(rows, at, mask)]): each group of rows over its own keys, the reference off CUDA."""
    R, _, H, D = q.shape
    Hkv = k_cache.shape[2]
    if how[0] == "flash":
        return flash_attn_with_kvcache(q.contiguous(), k_cache, v_cache, cache_seqlens=how[1],
                                       block_table=how[2], softmax_scale=scale)[:, 0]
    if how[0] == "varlen":
        return varlen_attn(q[:, 0].contiguous(), k_cache, v_cache, how[3], None, 1,
                           how[2].size(1) * k_cache.size(1), scale=scale, enable_gqa=True,
                           seqused_k=how[1], block_table=how[2])
    k_cache, v_cache = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)  # token positions

    def sdpa(q, k, v, mask):  # the query heads of one kv head are its rows: no repeat
        out = F.scaled_dot_product_attention(q.reshape(-1, Hkv, H // Hkv, D), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=mask, scale=scale)
        return out.reshape(-1, H, D)
    if how[0] == "masked":
        return sdpa(q, k_cache[how[2]], v_cache[how[2]], how[1])
    out = q.new_empty(R, H, D)
    for rows, at, mask in how[1]:
        if isinstance(rows, slice):
            out[rows] = sdpa(q[rows], k_cache[at], v_cache[at], mask)
        else:
            out.index_copy_(0, rows, sdpa(q[rows], k_cache[at], v_cache[at], mask))
    return out


def flat_positions(table, pos, block):
    """The flat pool positions of tokens pos (R, T) of rows whose block tables are table (R, W)."""
    return table.gather(1, pos // block).long() * block + pos % block


def _mlp(mlp, x):
    return _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))


@torch.no_grad()
def forward(model, ids, pos, cache, rope, qkv, table, rows=None, how=None):
    """Run new tokens ids (R, T) at positions pos (R, T). rows None: a decode step of cache rows
    0..R-1 (T = 1), attention per `how` (_decode) -> hidden (R, T, d). rows (R,): a prefill of those
    rows, pos 0..T-1, which only fills the cache (of the last layer it computes just the keys and
    values) -> None. rope: rope_tables(model, cache length); qkv: fused_qkv(model); table: the
    rows' block tables (slots, W) (new_cache). The model's
    own weights and modules; the norms and the rotary embedding in fewer ops (_norm, _rope), the
    same arithmetic."""
    inner = model.model
    x = inner.embed_tokens(ids)
    cos, sin = rope[0][pos][:, :, None], rope[1][pos][:, :, None]  # (R, T, 1, D): over heads
    if rows is None:
        rows = torch.arange(ids.size(0), device=x.device)
    at = flat_positions(table[rows], pos, cache[0][0].size(1)).view(-1)  # of the new tokens
    last = inner.layers[-1]
    for layer, layer_cache, w in zip(inner.layers, cache, qkv):
        h = _norm(layer.input_layernorm, x)
        if how is None and layer is last:  # a prefill: nothing reads its output
            _keys(layer.self_attn, h, cos, sin, layer_cache, at, w, keys_only=True)
            return None
        x = x + _attention(layer.self_attn, h, cos, sin, layer_cache, at, w, how)
        x = x + _mlp(layer.mlp, _norm(layer.post_attention_layernorm, x))
    return _norm(inner.norm, x)


def head_weight(model, fp32_head):
    """The LM head weight the logits are computed with: in at least float32 when fp32_head (paper
    section 3.2)."""
    w = model.lm_head.weight
    return w.to(torch.promote_types(w.dtype, torch.float32)) if fp32_head else w


def logits_of(hidden, weight):
    """Logits in at least float32 for the softmax, whatever the weights' dtype."""
    return (F.linear(hidden.to(weight.dtype), weight)
            .to(torch.promote_types(weight.dtype, torch.float32)))

# -----------------------------------------------------------------------------
# sampling: a pure function of (logits, temperature, counter-based noise)


GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15, splitmix64's increment, as a signed int64


def _mix(x):
    """splitmix64's finalizer on int64 tensors (wrapping arithmetic, logical shifts emulated)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9 as a signed int64
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * -7723592293110705685  # 0x94d049bb133111eb
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def noise_stream(seed, keys):
    """(B,) int64: the hash state of each sample, (seed, key) mixed in turn, each added with
    splitmix64's increment (the finalizer alone maps 0 to 0, so seed 0 / key 0 / position 0 would be
    special)."""
    return _mix(_mix(torch.full_like(keys, seed) + GOLDEN) + keys + GOLDEN)


def uniforms(stream, positions):
    """(B,) float64 uniforms in (0, 1) of noise streams at token positions: the top 53 bits of one
    more mix."""
    x = _mix(stream + positions + GOLDEN)  # (B,) int64
    return (((x >> 11) & ((1 << 53) - 1)).double() + 0.5) / (1 << 53)


def uniform_noise(seed, keys, positions):
    """(B,) float64 uniforms, a deterministic function of (seed, noise key, position) alone."""
    return uniforms(noise_stream(seed, keys), positions)


def cdf_block(vocab):
    """The block size of the two-level inverse CDF: the largest divisor of vocab up to 256 (128 at
    Qwen2's 151,936; a prime vocab gives 1, i.e. one flat float64 CDF)."""
    return max(d for d in range(1, 257) if vocab % d == 0)


def sample(logits, temperature, u):
    """logits (B, V) float32, u (B,) float64 uniforms (uniform_noise) -> (tokens (B,), log-probs
    (B,) of the sampling distribution). Temperature 0: the argmax, u unused.

    An inverse-CDF draw: the first token whose cumulative probability reaches u x (total mass), u
    the row's uniform. Two levels, both summed in float64 (a float32 running sum would shift
    interval ends by ~sqrt(V) ulps: ~2e-5 at V = 152k): the CDF of the blocks' masses picks the
    block, the CDF inside that block picks the token. The block's own sum may differ from its
    float64 block mass in the last bit; the leftover is clamped to the block's total, so the token
    drawn always has nonzero probability. Passes over the (B, V) logits: max, exp, block sums;
    everything after touches (B, V / block) or (B, block)."""
    B, V = logits.shape
    z = logits / temperature if temperature not in (0, 1) else logits
    m = z.amax(-1, keepdim=True)  # (B, 1)
    p = (z - m).exp_()  # (B, V) float32, unnormalised
    if temperature == 0:
        tokens = z.argmax(-1)
        total = p.sum(-1, dtype=torch.float64)
    else:
        block = cdf_block(V)
        blocks = p.view(B, V // block, block)
        mass = F.pad(blocks.sum(-1, dtype=torch.float64),
                     (1, 0)).cumsum(-1)  # (B, 1 + nb) mass before each block
        total = mass[:, -1]  # and after the last one
        u = (u * total)[:, None]  # (B, 1) <= total: a block always reaches it; > 0 = mass[:, 0]
        b = torch.searchsorted(mass, u) - 1  # (B, 1) the first block whose
                                             # cumulative mass reaches u
        inside = blocks[torch.arange(B, device=z.device), b[:, 0]].double().cumsum(-1)  # (B, block)
        j = torch.searchsorted(inside,
                               torch.minimum(u - mass.gather(1, b), inside[:, -1:]))  # (B, 1)
        tokens = (b * block + j)[:, 0]
    logp = z.gather(-1, tokens[:, None])[:, 0] - m[:, 0] - total.log().float()
    return tokens, logp

# -----------------------------------------------------------------------------
# the decode step: static shapes, every slot's bookkeeping in device tensors


def cut_point(seed, key, think_budget):
    """The interruption point of one sample: uniform over the last ~1/6 of the thinking budget."""
    return random.Random(f"{seed}-{key}").randint(think_budget - think_budget // 6, think_budget)


def bucket_sizes(cap, smallest):
    """The sizes a captured step comes in: powers of two from `smallest` below cap, then cap."""
    return [2 ** i for i in range(smallest.bit_length() - 1, cap.bit_length())
            if smallest <= 2 ** i < cap] + [cap]


def bucket(n, sizes):
    """The smallest size >= n."""
    return next(s for s in sizes if s >= n)


def len_bucket(n, cap):
    """The keys a group of rows of up to n keys attends over: n rounded up to a multiple of 16 or of
    1/16 of its power of two (at most 15 or n/8 more), at most cap."""
    step = max(16, 1 << max(0, n.bit_length() - 4))
    return min(-(-n // step) * step, cap)


def row_groups(lengths, cap, slack=1.2):
    """Rows 0..R-1 of up to lengths[r] keys grouped by len_bucket, neighbouring groups merged while
    the keys read stay within slack x the rows' (fewer calls) -> ((rows, S), ...): rows a slice
    where they are consecutive, else a tuple."""
    groups = {}
    for r, n in enumerate(lengths):
        groups.setdefault(len_bucket(max(int(n), 1), cap), []).append(r)
    groups = sorted(groups.items())  # [(S, rows)], S ascending
    # a row counts as 64 keys at least: below that, another call costs more than the keys it saves
    room = slack * sum(max(int(n), 64) for n in lengths) - sum(S * len(rs) for S, rs in groups)
    while len(groups) > 1:  # merge the pair that adds the fewest keys, while there is room
        cost, i = min(((groups[i + 1][0] - S) * len(rs), i)
                      for i, (S, rs) in enumerate(groups[:-1]))
        if cost > room:
            break
        room -= cost
        groups[i:i + 2] = [(groups[i + 1][0], sorted(groups[i][1] + groups[i + 1][1]))]
    return tuple((slice(rs[0], rs[-1] + 1) if rs[-1] - rs[0] + 1 == len(rs) else tuple(rs), S)
                 for S, rs in groups)


_KERNELS = {}  # (device, dtype, head dim) -> decode_kernel's choice


def decode_kernel(device, dtype=torch.bfloat16, head_dim=64, block=BLOCK):
    """The decode attention: on CUDA flash-attn's flash_attn_with_kvcache where importable, else
    torch's varlen_attn where it takes a block table (each checked once against SDPA here, at this
    dtype, head size and block size), else "masked" (every row over the longest row's length
    bucket: a CUDA graph needs static shapes). Off CUDA "groups": rows grouped by length, each over
    its own keys."""
    if device.type != "cuda":
        return "groups"
    key = (str(device), dtype, head_dim, block)
    if key not in _KERNELS:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(3 + 2 * (n > 1), n, h, head_dim, generator=g, device=device,
                               dtype=dtype)
                   for n, h in ((1, 4), (block, 2), (block, 2)))  # a pool of 5 blocks
        pos = torch.tensor([0, block + block // 2, 2 * block - 1], device=device)
        table = torch.tensor([[2, 4], [3, 1], [4, 2]], dtype=torch.int32, device=device)
        ref = _decode(q, k, v, 0.125, _how(("masked", 2 * block), pos, dtype, table, block))
        ok = {"flash": flash_attn_with_kvcache is not None,
              "varlen": (varlen_attn is not None
                         and "block_table" in inspect.signature(varlen_attn).parameters)}
        _KERNELS[key] = "masked"
        for kernel in [name for name in ("flash", "varlen") if ok[name]]:
            try:
                out = _decode(q, k, v, 0.125, _how((kernel,), pos, dtype, table, block))
            except Exception:  # a build without kernels for this GPU, dtype or block size
                continue
            if torch.allclose(out.float(), ref.float(), atol=2e-2):
                _KERNELS[key] = kernel
                break
    return _KERNELS[key]


def _how(plan, pos, dtype, table, block):
    """The attention argument of a decode step (_decode) from its plan, the rows' positions and
    block tables; a mask is additive, in the attention's dtype (one mask for every layer)."""
    if plan[0] == "flash":
        return "flash", (pos + 1).int(), table
    if plan[0] == "varlen":
        cu = torch.arange(pos.size(0) + 1, dtype=torch.int32, device=pos.device)
        return "varlen", (pos + 1).int(), table, cu

    def keys(t, S):  # (n, S): the flat positions of the first S keys of rows with tables t
        return flat_positions(t, torch.arange(S, device=pos.device).expand(t.size(0), S), block)

    def mask(p, S):  # (n, 1, 1, S): 0 for each row's keys so far, -inf after (key 0 always kept)
        return torch.zeros(p.size(0), 1, 1, S, dtype=dtype, device=pos.device).masked_fill_(
            torch.arange(S, device=pos.device) > p[:, None, None, None], float("-inf"))
    if plan[0] == "masked":
        return "masked", mask(pos, plan[1]), keys(table, plan[1])
    groups = []
    for rows, S in plan[1]:
        if not isinstance(rows, slice):
            rows = torch.tensor(rows, device=pos.device)
        groups.append((rows, keys(table[rows], S), mask(pos[rows], S)))
    return "groups", groups


def prefill_width(length, max_len):
    """The padded width of a prefill forward whose longest prompt has `length` tokens: all but the
    last, rounded up to a multiple of 16."""
    return min(-(-(length - 1) // 16) * 16, max_len)


def prefill_groups(lens, budget, max_len):
    """Consecutive prompts of lengths `lens` grouped into prefill forwards whose rows x padded
    width stays within `budget` tokens (one prompt at least): admitting many prompts never runs
    one huge forward -> [(first, end, width)]."""
    groups, a = [], 0
    while a < len(lens):
        b, top = a + 1, lens[a]
        while b < len(lens) and (b + 1 - a) * prefill_width(max(top, lens[b]), max_len) <= budget:
            top, b = max(top, lens[b]), b + 1
        groups.append((a, b, prefill_width(top, max_len)))
        a = b
    return groups


class Decoder:
    """The sampler's device side: the KV cache, every slot's state as (slots,) tensors, and the
    decode step.

    A decode step runs all of rows 0..R-1 (R from a few buckets), each over its own keys
    (decode_kernel, plan), with no host sync and no per-slot Python: the policy samples one token
    in every live row, forced-phrase tokens replace the draw where a row is being interrupted, and
    eos / </think> / budgets update the row's state and its finish code. Rows that are not live
    compute garbage that is never kept: they write only at their own next cache position and output
    column, which a live row rewrites before reading. On CUDA each (R, plan) step is captured once
    as a CUDA graph and replayed (graphs=True); elsewhere it runs eagerly. In-flight weight updates
    copy into the same parameter storage; the fused q/k/v weights and the float32 head copy are
    refreshed in place by new_weights(), so a captured graph reads the new weights."""

    def __init__(self, model, slots, max_len, max_new, *, eos_id, think_end, interrupt_ids,
                 think_budget, answer_budget, interrupt, temperature, fp32_head, seed,
                 version, graphs, prefill_tokens=PREFILL_TOKENS, blocks=None, block=BLOCK):
        dev = next(model.parameters()).device
        self.model, self.max_len, self.device = model, max_len, dev
        self.think_budget, self.answer_budget = think_budget, answer_budget
        self.interrupt, self.temperature, self.seed = interrupt, temperature, seed
        self.prefill_tokens = prefill_tokens
        self.eos = torch.tensor(eos_id, dtype=torch.long, device=dev).view(-1)  # (E,) any ends
        self.think_end = torch.tensor(think_end, dtype=torch.long, device=dev)  # (E,)
        self.phrase = torch.tensor(interrupt_ids or [0], dtype=torch.long,
                                   device=dev)  # (P,); unused without interrupt
        width, self.block = -(-max_len // block), block
        blocks = min(blocks or 1 + slots * width, 1 + slots * width)  # at most: all at max_len
        if blocks < 1 + width:
            raise ValueError(f"a KV pool of {blocks} blocks of {block} tokens cannot hold one row "
                             f"of {max_len} tokens and the scratch block")
        self.cache = new_cache(model, blocks, block)
        # each slot's blocks (reserve, release); 0, the scratch block, where it holds none: rows
        # that are not live write there
        self.table = torch.zeros(slots, width, dtype=torch.int32, device=dev)
        self.tables, self.held = np.zeros((slots, width), np.int32), np.zeros(slots, int)
        self.free, self.stale = list(range(blocks - 1, 0, -1)), False  # pop() takes the lowest
        self.qkv = fused_qkv(model)
        self.kernel = decode_kernel(dev, self.cache[0][0].dtype, head_dim_of(model.config), block)
        self.weight = head_weight(model, fp32_head).detach()  # the parameter itself, or a
                                                              # float32 copy of it
        long = lambda: torch.zeros(slots, dtype=torch.long, device=dev)
        flag = lambda: torch.zeros(slots, dtype=torch.bool, device=dev)
        self.rope = rope_tables(model, max_len)
        self.last, self.pos, self.n, self.cut, self.limit, self.finish = (long() for _ in range(6))
        # off: all False
        self.live, self.thinking, self.interrupted, self.off = flag(), flag(), flag(), flag()
        self.cols = cols = max_new + 1  # one spare column: rows that are not live write there
        self.tokens = torch.zeros(slots, cols, dtype=torch.long, device=dev)
        self.logps = torch.zeros(slots, cols,
                                 dtype=torch.promote_types(self.weight.dtype, torch.float32),
                                 device=dev)
        self.mask = torch.ones(slots, cols, dtype=torch.bool,
                               device=dev)  # only forced tokens write (a 0)
        self.versions = torch.zeros(slots, cols, dtype=torch.long, device=dev)
        self.noise = torch.full((slots, cols), 0.5, dtype=torch.float64,
                                device=dev)  # each row's uniforms, by position
        self.version = torch.tensor(version, device=dev)  # () the policy version in the weights
        self.graphs = {} if graphs else None
        self.pool = torch.cuda.graph_pool_handle() if graphs else None

    def new_weights(self, version):
        """After new weights were copied into the model: the new version, and the head copy
        refreshed."""
        self.version.fill_(version)
        fused_qkv(self.model, into=self.qkv)
        if self.weight is not self.model.lm_head.weight:
            self.weight.copy_(self.model.lm_head.weight)

    def reserve(self, slot, length):
        """Blocks for the slot's first `length` tokens, taken from the pool -> False (none taken)
        where too few are free."""
        need = -(-length // self.block) - self.held[slot]
        if need > len(self.free):
            return False
        for i in range(self.held[slot], self.held[slot] + max(need, 0)):
            self.tables[slot, i], self.stale = self.free.pop(), True
        self.held[slot] += max(need, 0)
        return True

    def release(self, slots):
        """Stop the rows in `slots` (finished or preempted) and return their blocks to the pool."""
        for s in slots:
            self.free += self.tables[s, :self.held[s]].tolist()
            self.tables[s], self.held[s], self.stale = 0, 0, True
        self.live[torch.tensor(slots, device=self.device)] = False

    def _tables(self):
        """The host's block tables copied to the device, where they changed."""
        if self.stale:
            self.table.copy_(torch.from_numpy(self.tables))
            self.stale = False

    def prefill(self, slots, prompts):
        """Fill the cache rows `slots` with their prompts but the last token (which the next decode
        step feeds), in forwards of at most prefill_tokens padded tokens (prefill_groups)."""
        self._tables()
        for a, b, width in prefill_groups([len(p) for p in prompts], self.prefill_tokens,
                                          self.max_len):
            if width:
                ids = torch.tensor([p[:-1] + [0] * (width + 1 - len(p)) for p in prompts[a:b]],
                                   device=self.device)  # (b - a, width)
                forward(self.model, ids,
                        torch.arange(width, device=self.device).expand(b - a, width), self.cache,
                        self.rope, self.qkv, self.table,
                        rows=torch.tensor(slots[a:b], device=self.device))

    def admit(self, slots, prompts, keys):
        """Start samples in free slots: their prompts prefilled, their state set."""
        dev, lens = self.device, [len(p) for p in prompts]
        rows = torch.tensor(slots, device=dev)
        self.prefill(slots, prompts)
        cut = [cut_point(self.seed, k, self.think_budget) if self.interrupt else self.max_len
               for k in keys]
        state = torch.tensor([[p[-1] for p in prompts], [m - 1 for m in lens], keys, cut],
                             device=dev)  # (4, n)
        self.last[rows], self.pos[rows], self.cut[rows] = state[0], state[1], state[3]
        self.noise[rows] = uniforms(noise_stream(self.seed, state[2])[:, None],
                                    torch.arange(self.cols, device=dev))
        self.n[rows], self.limit[rows], self.finish[rows] = (
            0, self.think_budget + self.answer_budget, 0)
        self.live[rows], self.thinking[rows], self.interrupted[rows] = True, True, False

    def plan(self, R, lengths):
        """What a step of rows 0..R-1 of at most lengths[r] keys each attends over (_how): the
        kernel's own lengths; or the longest row's bucket ("masked"); or groups by length."""
        if self.kernel == "groups":
            return "groups", row_groups(lengths, self.max_len)
        if self.kernel == "masked":
            return "masked", bucket(int(max(lengths)), bucket_sizes(self.max_len, 64))
        return (self.kernel,)

    def step(self, R, lengths):
        """One decode step of rows 0..R-1, row r of at most lengths[r] keys (host numbers: an upper
        bound): a graph replay on CUDA, else eager."""
        plan = self.plan(R, lengths)
        self._tables()
        if self.graphs is None:
            return self._step(R, plan, self.live[:R])
        graph = self.graphs.get((R, plan))
        if graph is None:
            stream = torch.cuda.Stream()  # warm up off the capture (lazy inits), with
                                          # every row masked off
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._step(R, plan, self.off[:R])
            torch.cuda.current_stream().wait_stream(stream)
            graph = self.graphs[(R, plan)] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._step(R, plan, self.live[:R])
        graph.replay()

    def _step(self, R, plan, live):
        """The static decode step; live (R,) picks the rows whose state it advances. Without
        interruption the phrase and the thinking state play no part, and their ops are left out."""
        n, pos, limit, interrupted = self.n[:R], self.pos[:R], self.limit[:R], self.interrupted[:R]
        how = _how(plan, pos, self.cache[0][0].dtype, self.table[:R], self.block)
        hidden = forward(self.model, self.last[:R, None], pos[:, None], self.cache, self.rope,
                         self.qkv, self.table, how=how)[:, 0]  # (R, d)
        tok, logp = sample(logits_of(hidden, self.weight), self.temperature,
                           self.noise[:R].gather(1, n[:, None])[:, 0])
        col = n[:, None]
        if self.interrupt:  # a row still thinking at its cut point takes the phrase, token by token
            # at: index into the phrase
            P, thinking, at = self.phrase.numel(), self.thinking[:R], n - self.cut[:R]
            interrupted |= live & thinking & (at == 0)
            forced = interrupted & (at < P)
            tok = torch.where(forced, self.phrase[at.clamp(0, P - 1)], tok)
            logp = torch.where(forced, 0.0, logp)
            self.mask[:R].scatter_(1, col, ~forced[:, None])
        self.tokens[:R].scatter_(1, col, tok[:, None])
        self.logps[:R].scatter_(1, col, logp[:, None])
        self.versions[:R].scatter_(1, col, self.version.expand(R, 1))
        # finishing: eos (not inside the phrase), the end of the thought, the budgets
        eos = (tok[:, None] == self.eos).any(-1)  # (R,): any of the eos ids
        if self.interrupt:
            pending = forced & (at < P - 1)  # more phrase tokens to come
            eos &= ~pending
            E = self.think_end.numel()
            tail = self.tokens[:R].gather(
                1, (col - E + 1 + torch.arange(E, device=self.device)).clamp_min(0))
            said = (n + 1 >= E) & (tail == self.think_end).all(-1)  # the last E tokens are </think>
            ends = live & thinking & ~pending & ~eos & (forced | said)  # forced here: the phrase's
                                                                        # last token
            limit.copy_(torch.where(ends, n + 1 + self.answer_budget, limit))  # the answer budget
                                                                               # starts now
            thinking &= ~ends
            over = ~pending & (n + 1 >= limit)
        else:
            over = n + 1 >= limit
        code = torch.where(eos, 1 + interrupted.long(),
                           torch.where(over, 3, 0)) * live  # 0 in rows not live
        self.finish[:R] += code  # a live row's finish is 0 until it finishes
        self.last[:R] = torch.where(live, tok, self.last[:R])
        n += live
        pos += live
        self.live[:R] &= code == 0  # rows that finished leave

    def collect(self, R):
        """The rows among 0..R-1 that finished: {slot: Sample}, read with one host sync (plus one
        per copy when some did); their slots and blocks are then free."""
        finish = self.finish[:R].tolist()
        done = [s for s in range(R) if finish[s]]
        if not done:
            return {}
        rows = torch.tensor(done, device=self.device)
        lens = self.n[rows].tolist()
        width = max(lens)
        tokens, logps, mask, versions = (x[rows, :width].tolist()
                                         for x in (self.tokens, self.logps, self.mask,
                                                   self.versions))
        self.finish[rows] = 0
        self.release(done)
        return {s: Sample(None, tokens[i][:m], logps[i][:m], [int(b) for b in mask[i][:m]],
                          versions[i][:m], FINISH[finish[s] - 1])
                for i, (s, m) in enumerate(zip(done, lens))}

# -----------------------------------------------------------------------------
# the sampler's size: its KV cache by memory, not by a slot count


def cache_length(max_prompt_len, think_budget, answer_budget, interrupt_ids, interrupt=True):
    """-> (max_len, max_new): the cache positions of one slot (the longest prompt, every budget and
    the interruption phrase; the last completion token never enters the cache: one spare) and the
    completion tokens one sample may have."""
    max_new = think_budget + answer_budget + (len(interrupt_ids) if interrupt else 0)
    return max_prompt_len + max_new, max_new


def kv_bytes_per_token(config, dtype):
    """KV-cache bytes of one token: a key and a value per layer and kv head."""
    return (2 * config.num_hidden_layers * config.num_key_value_heads * head_dim_of(config)
            * dtype.itemsize)


def decoder_bytes(config, dtype, max_len, max_new, fp32_head, n_ids=3, block=BLOCK):
    """What a Decoder allocates -> (bytes per slot: six int64 and four bool scalars, its block
    table, max_new + 1 columns of token, log-prob, mask, version and noise; bytes per block of the
    KV pool; bytes whatever the slots: the rotary tables, the float32 head copy, the fused q/k/v
    weights, the n_ids ids of </think>, the phrase and eos, the version)."""
    size = dtype.itemsize
    per_slot = (6 * 8 + 4 + 4 * -(-max_len // block)
                + (max_new + 1) * (8 + max(size, 4) + 1 + 8 + 8))  # log-probs: >= float32
    copy = fp32_head and size < 4  # head_weight's float32 copy of a half-precision head
    fixed = (2 * max_len * head_dim_of(config) * size
             + copy * 4 * config.vocab_size * config.hidden_size + 8 * (n_ids + 1)
             + qkv_bytes(config, dtype))
    return per_slot, kv_bytes_per_token(config, dtype) * block, fixed


def qkv_bytes(config, dtype):
    """The fused q/k/v weights and biases of every layer (fused_qkv; Qwen2's projections have
    biases, Llama's and Mistral's where attention_bias), and Qwen3's q/k norm weight."""
    width = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim_of(config)
    bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
    norm = (config.num_attention_heads + config.num_key_value_heads) * head_dim_of(config)
    return (config.num_hidden_layers * dtype.itemsize
            * (width * (config.hidden_size + bias) + norm * (config.model_type == "qwen3")))


def free_device_bytes(device):
    """Device memory free for new tensors: the driver's free memory plus what torch's caching
    allocator holds but does not use."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def mean_length(max_len, max_new):
    """A row's mean length in flight, what the pool is sized by: its prompt and half its budget."""
    return max_len - max_new // 2


def slots_in(room, config, dtype, max_len, max_new, fp32_head=True, cap=None, block=BLOCK):
    """A Decoder in `room` bytes (decoder_bytes) -> (slots: the rows that fit at mean_length, at
    most cap; blocks: the pool in the rest, at most every slot at max_len, the scratch block
    included; the rows that would fit without the cap). (0, 0, _) where one row at max_len does
    not fit."""
    per_slot, per_block, fixed = decoder_bytes(config, dtype, max_len, max_new, fp32_head,
                                               block=block)
    width, mean = -(-max_len // block), -(-mean_length(max_len, max_new) // block)
    fit = max(0, int((room - fixed - per_block) // (per_slot + mean * per_block)))
    slots = min(fit, cap or fit)
    blocks = min(1 + slots * width, int((room - fixed - slots * per_slot) // per_block))
    return (slots, blocks, fit) if blocks >= 1 + width else (0, 0, fit)


def fit_slots(model, max_len, max_new, gen_memory=0.85, cap=None, fp32_head=True, most=None):
    """How many sequences the sampler decodes at once and its KV pool -> (slots, blocks or None:
    every slot at max_len, a line saying why or None).

    On CUDA the KV cache is sized by memory, not by a slot count (vLLM's gpu_memory_utilization,
    read here of the memory left after the weights): gen_memory x the device memory free now
    (slots_in: rows at their mean length, a pool of blocks), at most cap and `most` rows (the
    sequences its caller can ever have in flight). The rest is headroom for the decode step's
    logits, the prefill forward and the CUDA graphs. Elsewhere: cap, or CPU_SLOTS."""
    p = next(model.parameters())
    if p.device.type != "cuda":
        return cap or CPU_SLOTS, None, None
    free = free_device_bytes(p.device)
    caps = [c for c in (cap, most) if c]
    slots, blocks, fit = slots_in(gen_memory * free, model.config, p.dtype, max_len, max_new,
                                  fp32_head, min(caps) if caps else None)
    per_block = kv_bytes_per_token(model.config, p.dtype) * BLOCK
    if not slots:
        raise ValueError(f"one sequence of {max_len} tokens needs "
                         f"{-(-max_len // BLOCK) * per_block / 1e9:.2f} GB of KV cache; "
                         f"{gen_memory} x {free / 1e9:.2f} GB free is not enough (raise "
                         "--gen_memory, lower the budgets, or use a device with more memory)")
    bound = (f", --slots {cap}" if cap and cap == slots else
             f", at most {most} in flight" if most and most == slots else "")
    return slots, blocks, (
        f"sampler: {slots} sequences of up to {max_len} tokens at once, KV cache {blocks} blocks "
        f"of {BLOCK} tokens, {blocks * per_block / 1e9:.1f} GB (--gen_memory {gen_memory} of the "
        f"{free / 1e9:.1f} GB free after the weights fits {fit} rows of "
        f"{mean_length(max_len, max_new)} tokens, the mean{bound})")

# -----------------------------------------------------------------------------
# the continuous-batching loop


@torch.no_grad()
def sampler(model, *, eos_id, think_end, interrupt_ids, think_budget, answer_budget, max_prompt_len,
            interrupt=True, slots=64, temperature=1.0, fp32_head=True, seed=0, version=0,
            graphs=None, sync_every=None, prefill_tokens=PREFILL_TOKENS, blocks=None, block=BLOCK):
    """The continuous-batching sampler as a Python generator, driven by the caller:

        steps = sampler(model, ...)
        finished, n_free = next(steps)                  # nothing has run yet: ([], slots)
        finished, n_free = steps.send((new, version))   # up to sync_every decode steps

    new: prompts to queue, [(prompt ids, noise key, tag)]; version: the policy version now in the
    model's weights (the caller may copy new weights in between two sends; the cache stays). A send
    admits queued prompts into free slots (batched prefills of at most prefill_tokens padded
    tokens each, one prompt at least), runs sync_every decode steps
    (default: 8 on CUDA, where a host sync drains the GPU's queue; 1 elsewhere), then yields the
    samples that finished, [(tag, Sample)], and how many slots are free for more prompts. With
    nothing running or queued it yields ([], slots) at once. Without interruption (interrupt=False)
    a sample is simply cut at think_budget + answer_budget tokens. eos_id (the id, or a list of the
    ids, that end a sample), think_end (the token ids of "</think>") and interrupt_ids (the
    interruption phrase's): data.special_tokens(tokenizer, model) gives all three. max_prompt_len
    sizes the cache (cache_length); a longer prompt is an error. slots, blocks: fit_slots sizes
    them by memory (default blocks: every slot at max_len). A prompt is admitted when blocks for it
    are free; when the pool runs out, the newest rows are queued again from their prompts (same
    key, same sample). graphs: capture decode steps as CUDA graphs (default: on CUDA).
    """
    check_supported(model)
    if interrupt and not interrupt_ids:
        raise ValueError("interrupt=True needs the interruption phrase's token ids (interrupt_ids)")
    device = next(model.parameters()).device
    graphs = device.type == "cuda" if graphs is None else graphs
    sync_every = (8 if device.type == "cuda" else 1) if sync_every is None else sync_every
    max_len, max_new = cache_length(max_prompt_len, think_budget, answer_budget, interrupt_ids,
                                    interrupt)
    dec = Decoder(model, slots, max_len, max_new, eos_id=eos_id, think_end=think_end,
                  interrupt_ids=interrupt_ids, think_budget=think_budget,
                  answer_budget=answer_budget, interrupt=interrupt, temperature=temperature,
                  fp32_head=fp32_head, seed=seed, version=version, graphs=graphs,
                  prefill_tokens=prefill_tokens, blocks=blocks, block=block)
    row_sizes = bucket_sizes(slots, 8)  # a step decodes rows 0..R-1, R one of these
    pending = deque()  # (prompt ids, key, tag) waiting for a slot
    owner = [None] * slots  # per slot: (prompt, key, tag) of the sample in it, or None when free
    order = []  # the busy slots, oldest first
    bound = np.full(slots, -1)  # per slot: an upper bound of its cache position (-1: free)
    finished = []
    while True:
        new, new_version = yield finished, owner.count(None) - len(pending)
        finished = []
        for p, key, tag in new:
            if not 0 < len(p) <= max_prompt_len:
                raise ValueError(f"prompt of {len(p)} tokens: a prompt needs 1 to "
                                 f"max_prompt_len = {max_prompt_len}")
            pending.append((p, key, tag))
        if new_version != version:  # in-flight update: weights changed, the cache stays
            version = new_version
            dec.new_weights(version)
        preempted = False  # every row's blocks for this round, oldest first; where they run out,
        for s in list(order):  # the newest row gives its blocks back and waits for them again
            while owner[s] and not dec.reserve(s, min(bound[s] + sync_every, max_len)):
                last = order.pop()
                dec.release([last])
                pending.appendleft(owner[last])
                owner[last], bound[last], preempted = None, -1, True
        free, items = [s for s in range(slots) if owner[s] is None], []
        while (pending and len(items) < len(free) and not preempted and dec.reserve(
                free[len(items)], min(len(pending[0][0]) - 1 + sync_every, max_len))):
            items.append(pending.popleft())
        if items:
            dec.admit(free[:len(items)], [p for p, _, _ in items], [key for _, key, _ in items])
            for s, item in zip(free, items):
                owner[s], bound[s] = item, len(item[0]) - 1
                order.append(s)
        busy = [s for s in range(slots) if owner[s] is not None]
        if not busy:
            continue
        R = bucket(busy[-1] + 1, row_sizes)
        for _ in range(sync_every):
            dec.step(R, bound[:R] + 1)
            bound[busy] = np.minimum(bound[busy] + 1, max_len - 1)
        for s, sample in dec.collect(R).items():
            (_, sample.key, tag), owner[s], bound[s] = owner[s], None, -1
            order.remove(s)
            finished.append((tag, sample))


def generate(model, prompts, *, keys=None, slots=64, version=0, stop=None, max_prompt_len=None,
             gen_memory=None, **settings):
    """Sample one completion per prompt (lists of token ids) -> list of Sample, in prompt order.
    keys: per-prompt noise keys (default 0..n-1): equal keys and seed give equal draws, whatever the
    batching. stop: a callable polled between decode steps; once it returns true, generate gives up
    and returns None (a Ctrl-C under way). max_prompt_len: sizes the cache (default: the longest
    prompt). gen_memory: size the slots by the memory free now (fit_slots; slots is then a cap, or
    None). settings: the sampler's (eos_id, think_end, interrupt_ids, the budgets, ...)."""
    keys = range(len(prompts)) if keys is None else keys
    results = [None] * len(prompts)
    max_prompt_len = max_prompt_len or max(map(len, prompts), default=1)
    if gen_memory:
        lengths = cache_length(max_prompt_len, settings["think_budget"],
                               settings["answer_budget"], settings["interrupt_ids"],
                               settings.get("interrupt", True))
        slots, settings["blocks"], _ = fit_slots(model, *lengths, gen_memory, slots,
                                                 settings.get("fp32_head", True))
    steps = sampler(model, slots=min(slots, len(prompts)), max_prompt_len=max_prompt_len,
                    version=version, **settings)
    next(steps)
    new, left = list(zip(prompts, keys, range(len(prompts)))), len(prompts)
    while left:
        if stop is not None and stop():
            steps.close()
            return None
        finished, _ = steps.send((new, version))
        new, left = [], left - len(finished)
        for i, s in finished:
            results[i] = s
    return results

# -----------------------------------------------------------------------------
# the trainer's side: log-probs of given tokens, float32 head, in chunks


# "auto": activation checkpointing of the decoder layers for models of more than this many layers
# (the toy's 2-layer models run as before; a 0.5B-8B model has 24-36)
CHECKPOINT_ABOVE = 4
# the float32 logits of one chunk of the trainer's head: 256 MiB (441 tokens at a 152k vocab; the
# toy's whole batch)
LOGITS_BYTES = 2 ** 28
PACKED = "scalerl_packed"  # the training forward's attention in HF's AttentionInterface
try:  # varlen kernels: flash-attn's, else torch's own (torch >= 2.9); CUDA in half precision only
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None
try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None


def checkpointing(n_layers, checkpoint_layers=None):
    """Whether the training forward of a model of n_layers decoder layers recomputes each layer in
    the backward: True / "on", False / "off", or None / "auto" (on above CHECKPOINT_ABOVE)."""
    if checkpoint_layers in (None, "auto"):
        return n_layers > CHECKPOINT_ABOVE
    if checkpoint_layers in (True, "on", False, "off"):
        return checkpoint_layers in (True, "on")
    raise ValueError(f"checkpoint_layers must be auto, on or off, got {checkpoint_layers!r}")


def varlen_attention(q, k, v, lens, cu, scale):
    """Causal attention within each sample of a packed row: q (T, H, D), k, v (T, Hkv, D), the
    samples' lengths `lens` and their int32 boundaries cu (N+1,) -> (T, H, D). On CUDA in half
    precision a varlen flash kernel; elsewhere each sample's own SDPA: exact, the reference."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        if flash_attn_varlen_func is not None:
            return flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens),
                                          softmax_scale=scale, causal=True)
        if varlen_attn is not None:
            return _torch_varlen(q, k, v, cu, max(lens), scale)
    t = lambda x: x.transpose(0, 1)[None]  # (1, H, L, D)
    out = [F.scaled_dot_product_attention(t(a), t(b), t(c), is_causal=True, scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1)
           for a, b, c in zip(q.split(lens), k.split(lens), v.split(lens)) if len(a)]
    return out[0] if len(out) == 1 else torch.cat(out)  # one sample: no copy


def _torch_varlen(q, k, v, cu, longest, scale):
    """torch.nn.attention.varlen.varlen_attn, causal, across its versions' keywords."""
    params = inspect.signature(varlen_attn).parameters
    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:  # one k, v head per query head
        k, v = (x.repeat_interleave(q.size(1) // x.size(1), 1) for x in (k, v))
    if "scale" in params:
        kw["scale"] = scale
    else:  # its default scale is D^-0.5
        q = q * (scale * q.size(-1) ** 0.5)
    return varlen_attn(q, k, v, cu, cu, longest, longest, **kw)


def _packed_attention(module, q, k, v, attention_mask, dropout=0.0, scaling=None, packed=None,
                      **_):
    """HF's attention interface on a packed row: q (1, H, T, D), k, v (1, Hkv, T, D) ->
    ((1, T, H, D), None)."""
    t = lambda x: x[0].transpose(0, 1)
    return varlen_attention(t(q), t(k), t(v), *packed, scaling)[None], None


def decoder_states(model, ids, lens, checkpoint_layers=None):
    """The last decoder layer's output for samples packed into one row, ids (T,), lens their
    lengths (summing to T) -> (1, T, d), with grad.

    The model's own decoder layers, their attention causal within each sample (_packed_attention,
    varlen_attention) and the rotary positions restarting at 0 per sample: no padded token is
    computed. With checkpointing each layer keeps only its input (1, T, d) for the backward and is
    run again there (non-reentrant torch.utils.checkpoint: it composes with FSDP2's hooks)."""
    from transformers import AttentionInterface
    AttentionInterface.register(PACKED, _packed_attention)
    inner = model.model
    x = inner.embed_tokens(ids)[None]  # (1, T, d)
    n = torch.tensor(lens, device=ids.device)
    cu = F.pad(n.cumsum(0), (1, 0)).to(torch.int32)  # (N+1,) the samples' boundaries
    pos = (torch.arange(len(ids), device=ids.device)
           - torch.repeat_interleave(cu[:-1].long(), n, output_size=len(ids)))[None]  # (1, T)
    rope = inner.rotary_emb(x, pos)  # cos, sin (1, T, D)
    recompute = checkpointing(len(inner.layers), checkpoint_layers)
    for layer in inner.layers:
        x = (checkpoint(_layer, layer, x, *rope, pos, (lens, cu), use_reentrant=False)
             if recompute else _layer(layer, x, *rope, pos, (lens, cu)))
    return x


def _layer(layer, x, cos, sin, pos, packed):
    """One decoder layer on a packed row, its tensors as positional arguments (a checkpoint saves
    those where saved-tensor hooks see them: bench.saved_bytes). Its attention is _packed_attention
    for this call, the recompute included."""
    config = layer.self_attn.config
    impl, config._attn_implementation = config._attn_implementation, PACKED
    try:
        return layer(x, position_embeddings=(cos, sin), position_ids=pos, packed=packed)
    finally:
        config._attn_implementation = impl


def tensor_core_head(device_type, dtype, fp32_head):
    """Whether the float32 head runs as a bf16 GEMM with float32 accumulation and output
    (_Bf16Head): on CUDA with bf16 weights, where torch's mm takes out_dtype; elsewhere the float32
    GEMM (logits_of), the reference."""
    return (fp32_head and device_type == "cuda" and dtype == torch.bfloat16
            and hasattr(torch.ops.aten.mm, "dtype"))


def _mm32(a, b):
    return torch.mm(a, b, out_dtype=torch.float32)


class _Bf16Head(torch.autograd.Function):
    """h (t, d) @ w16 (V, d).T -> float32 logits on tensor cores: bf16 inputs hold the same values
    the float32 head upcasts, so only the accumulation order differs. The backward's GEMMs take the
    logits' gradient rounded to bf16; the weight's gradient goes to w32 (the float32 cast the
    chunks share), so the chunks sum it in float32 as before."""

    @staticmethod
    def forward(ctx, h, w16, w32):
        ctx.save_for_backward(h, w16)
        return _mm32(h, w16.t())

    @staticmethod
    def backward(ctx, g):
        h, w16 = ctx.saved_tensors
        g = g.to(h.dtype)
        return _mm32(g, w16).to(h.dtype), None, _mm32(g.t(), h)


def _chunk_logprobs(norm, states, weight, targets, temperature, w16=None):
    h = norm(states)
    logits = (_Bf16Head.apply(h, w16, weight) if w16 is not None and h.dtype == w16.dtype
              else logits_of(h, weight))  # (t, V) float32, one chunk at a time
    if temperature not in (0, 1):
        logits = logits / temperature
    return logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)


def packed_logprobs(model, ids, lens, fp32_head=True, temperature=1.0, chunk=None,
                    checkpoint_layers=None):
    """log p(sample[t+1] | sample[:t+1]) of samples packed into one row, ids (T,), lens their
    lengths -> (N, max(lens) - 1), each row zero past its sample, with grad (decoder_states).

    The final norm, the float32 head and the log-softmax run in chunks of `chunk` positions
    (default: as many as keep one chunk's float32 logits within LOGITS_BYTES) under activation
    checkpointing: the backward keeps only the last layer's output (T, d) and the targets, and one
    chunk's (chunk, V) logits exist at a time, so memory is O(chunk x V), not O(T x V)."""
    states = decoder_states(model, ids, lens, checkpoint_layers)[0, :-1]  # (T-1, d)
    weight = head_weight(model, fp32_head)  # with grad: the cast is part of the graph
    w = model.lm_head.weight
    w16 = w if tensor_core_head(w.device.type, w.dtype, fp32_head) else None
    targets = ids[1:]
    chunk = chunk or max(1, LOGITS_BYTES // (weight.size(0) * 4))
    flat = torch.cat([checkpoint(_chunk_logprobs, model.model.norm, states[a:a + chunk], weight,
                                 targets[a:a + chunk], temperature, w16, use_reentrant=False)
                      for a in range(0, len(states), chunk)]
                     + [states.new_zeros(1, dtype=torch.float32)])  # (T,)
    # a sample's last position predicts the next sample's first token: dropped
    return torch.nn.utils.rnn.pad_sequence([r[:-1] for r in flat.split(lens)], batch_first=True)


def sequence_logprobs(model, ids, attention_mask=None, fp32_head=True, temperature=1.0,
                      chunk=None, checkpoint_layers=None):
    """log p(ids[:, t+1] | ids[:, :t+1]) for every t of a right-padded batch ids (N, T) -> (N, T-1),
    zero on padding, with grad: its rows packed (packed_logprobs). attention_mask (N, T), optional:
    checked to be right padding."""
    if attention_mask is not None and (attention_mask[:, 1:] > attention_mask[:, :-1]).any():
        raise ValueError("sequence_logprobs needs right-padded rows (real tokens, then padding)")
    N, T = ids.shape
    lens = attention_mask.sum(1).tolist() if attention_mask is not None else [T] * N
    lp = packed_logprobs(model, torch.cat([row[:L] for row, L in zip(ids, lens)]), lens,
                         fp32_head, temperature, chunk, checkpoint_layers)
    return F.pad(lp, (0, T - 1 - lp.size(1)))


if __name__ == "__main__":
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from data import (completion_text, prompt_ids, resolve_model, special_tokens, toy_model_dir,
                      toy_problems)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
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
    args = ap.parse_args()
    transformers.utils.logging.disable_progress_bar()
    try:
        path = resolve_model(args.model) if args.model else toy_model_dir()
    except ValueError as err:
        sys.exit(f"error: --model {err}")
    tokenizer, model = (AutoTokenizer.from_pretrained(path, trust_remote_code=False),
                        AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False).eval())
    problems = [args.prompt] if args.prompt else [p["prompt"] for p in toy_problems(3, 0)]
    problems = [p for p in problems for _ in range(args.n)]
    try:  # a chat template that fails or loops (format_prompt: once, under a time limit)
        prompts = [prompt_ids(tokenizer, p) for p in problems]
    except ValueError as err:
        sys.exit(f"error: --model {path}: {err}")
    out = generate(model, prompts, **special_tokens(tokenizer, model),
                   think_budget=args.think_budget, answer_budget=args.answer_budget,
                   temperature=args.temperature, seed=args.seed)
    for p, s in zip(problems, out):
        print(f"{p!r} -> [{s.finish}] {completion_text(tokenizer, s)!r}")
