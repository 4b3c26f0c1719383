"""
generate.py: the generator's KV-cache sampler with its float32 LM head (arXiv 2510.13786,
sections 3.1-3.2); the trainer's log-probs of the same tokens are trainer.py's.

Start at `sampler`: continuous batching, in-flight weight updates (the KV cache kept, as
PipelineRL), forced interruption. `Decoder` is its device side: a static-shape decode step, a CUDA
graph per step size. The KV cache is a pool of blocks that rows take as they grow; a row is
admitted while the pool holds every row at the length samples reach, and where it still runs
out the newest rows restart from their prompts. A sample is a function of its noise key, whatever
its slot, batch or restarts.

    python generate.py                        # a few toy completions
    python generate.py --model Qwen/Qwen3-0.6B --prompt "What is 2+2?" --think_budget 512
"""

if __name__ == "__main__":  # flags, --help and their errors before torch's seconds of imports
    import config
    config.parse_first(config.sample_parser(__doc__.split("\n\n")[0]))

import heapq
import random
import sys
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from checks import check_supported
from paged_attention import attention_inputs, decode_attention, decode_kernel, flat_positions

FINISH = ("eos", "interrupted", "truncated")  # c > 0 means FINISH[c - 1]
CPU_SLOTS = 128
PREFILL_TOKENS = 8192
BLOCK = 256  # KV-cache tokens per block (flash-attn's paged-KV page size)


@dataclass
class Sample:
    key: int  # noise key
    tokens: list
    logps: list
    mask: list  # 0 = forced (no loss)
    versions: list
    finish: str


# -----------------------------------------------------------------------------
# the forward pass


def head_dim_of(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_block(device_type, max_len, block=BLOCK):
    """Tokens per KV block: off CUDA (no paged kernel's page size) at most a row, so short rows
    take less."""
    return block if device_type == "cuda" else min(block, max_len)


def new_cache(model, blocks, block=BLOCK):
    """Per layer (k, v) pools of blocks: token t of a row at table[row, t // block], t % block."""
    cfg = model.config
    p = next(model.parameters())
    shape = (blocks, block, cfg.num_key_value_heads, head_dim_of(cfg))
    return [(torch.zeros(shape, dtype=p.dtype, device=p.device),
             torch.zeros(shape, dtype=p.dtype, device=p.device))
            for _ in range(cfg.num_hidden_layers)]


def fused_qkv(model, into=None):
    """Per layer the q/k/v weights (one GEMM) and Qwen3's q/k norm, concatenated; refreshed via
    `into`."""
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
    """cos and sign-flipped sin (for _rope) of positions 0..n-1."""
    p = next(model.parameters())
    cos, sin = model.model.rotary_emb(p[:0], torch.arange(n, device=p.device)[None])
    half = cos.size(-1) // 2
    return cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)


def _linear(module, x):
    """A projection without a module call's overhead (sizeable in a decode step)."""
    return F.linear(x, module.weight, module.bias)


def _norm(module, x):
    """The model's RMSNorm in fewer ops, the same arithmetic."""
    return module.weight * F.rms_norm(x.float(), x.shape[-1:],
                                      eps=module.variance_epsilon).to(x.dtype)


def _rope(x, cos, sin_signed):
    """x cos + rotate_half(x) sin, bit for bit the model's (a fused addcmul rounds once less)."""
    return x * cos + x.roll(x.size(-1) // 2, -1) * sin_signed


def _keys(attn, x, cos, sin, cache, at, qkv, keys_only=False):
    """Project, rotary-embed, write k and v at flat cache positions `at` -> q, k, v."""
    w, b, norm = qkv
    D, Hkv = attn.head_dim, cache[0].size(2)
    H = 0 if keys_only else w.size(0) // D - 2 * Hkv
    if keys_only:
        w, b = w[-2 * Hkv * D:], None if b is None else b[-2 * Hkv * D:]
    y = F.linear(x, w, b).view(*x.shape[:2], -1, D)
    qk, v = y[:, :, :H + Hkv], y[:, :, H + Hkv:]
    if norm is not None:
        qk = norm[-(H + Hkv):] * F.rms_norm(qk.float(), (D,),
                                            eps=attn.k_norm.variance_epsilon).to(qk.dtype)
    q, k = _rope(qk, cos, sin).split([H, Hkv], 2)
    for c, t in zip(cache, (k, v)):
        c.view(-1, Hkv, D).index_copy_(0, at, t.reshape(-1, Hkv, D))
    return (None if keys_only else q), k, v


def _attention(attn, x, cos, sin, cache, at, qkv, how):
    R, T, _ = x.shape
    q, k, v = _keys(attn, x, cos, sin, cache, at, qkv)
    if how is None:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True, scale=attn.scaling,
                                             enable_gqa=True)
        return _linear(attn.o_proj, out.transpose(1, 2).reshape(R, T, -1))
    return _linear(attn.o_proj, decode_attention(q, *cache, attn.scaling, how).reshape(R, 1, -1))


def _mlp(mlp, x):
    return _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))


@torch.no_grad()
def forward(model, ids, pos, cache, rope, qkv, table, rows=None, how=None):
    """A decode step -> hidden (R, 1, d), or a prefill of cache `rows` -> None; table: the rows'
    block tables."""
    inner = model.model
    x = inner.embed_tokens(ids)
    cos, sin = rope[0][pos][:, :, None], rope[1][pos][:, :, None]
    if rows is None:
        rows = torch.arange(ids.size(0), device=x.device)
    at = flat_positions(table[rows], pos, cache[0][0].size(1)).view(-1)
    last = inner.layers[-1]
    for layer, layer_cache, w in zip(inner.layers, cache, qkv):
        h = _norm(layer.input_layernorm, x)
        if how is None and layer is last:
            _keys(layer.self_attn, h, cos, sin, layer_cache, at, w, keys_only=True)
            return None
        x = x + _attention(layer.self_attn, h, cos, sin, layer_cache, at, w, how)
        x = x + _mlp(layer.mlp, _norm(layer.post_attention_layernorm, x))
    return _norm(inner.norm, x)


def head_weight(model, fp32_head):
    """The LM head weight, float32 when fp32_head (paper section 3.2)."""
    w = model.lm_head.weight
    return w.to(torch.promote_types(w.dtype, torch.float32)) if fp32_head else w


def logits_of(hidden, weight):
    return (F.linear(hidden.to(weight.dtype), weight)
            .to(torch.promote_types(weight.dtype, torch.float32)))


def tensor_core_head(device_type, dtype, fp32_head):
    """Can the float32 head be a bf16 GEMM with float32 output (tensor cores, the same values)?"""
    return (fp32_head and device_type == "cuda" and dtype == torch.bfloat16
            and hasattr(torch.ops.aten.mm, "dtype"))


def mm32(a, b):
    """a @ b with float32 output (float32 accumulation), the sampler's and the trainer's head."""
    return torch.mm(a, b, out_dtype=torch.float32)

# -----------------------------------------------------------------------------
# sampling


GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15, splitmix64's increment


def _mix(x):
    """splitmix64's finalizer on int64 tensors."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * -7723592293110705685  # 0x94d049bb133111eb
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def noise_stream(seed, keys):
    return _mix(_mix(torch.full_like(keys, seed) + GOLDEN) + keys + GOLDEN)


def uniforms(stream, positions):
    x = _mix(stream + positions + GOLDEN)
    return (((x >> 11) & ((1 << 53) - 1)).double() + 0.5) / (1 << 53)


def uniform_noise(seed, keys, positions):
    """(B,) float64 uniforms, a function of (seed, key, position) alone."""
    return uniforms(noise_stream(seed, keys), positions)


def cdf_block(vocab):
    """The inverse CDF's block: the largest divisor of vocab up to 256."""
    return max(d for d in range(1, 257) if vocab % d == 0)


def sample(logits, temperature, u):
    """-> (tokens, log-probs of the sampling distribution): an inverse-CDF draw of u, summed in
    float64 (float32 shifts interval ends by ~sqrt(V) ulps)."""
    B, V = logits.shape
    z = logits / temperature if temperature not in (0, 1) else logits
    m = z.amax(-1, keepdim=True)
    p = (z - m).exp_()
    if temperature == 0:
        tokens = z.argmax(-1)
        total = p.sum(-1, dtype=torch.float64)
    else:
        block = cdf_block(V)
        blocks = p.view(B, V // block, block)
        mass = F.pad(blocks.sum(-1, dtype=torch.float64), (1, 0)).cumsum(-1)
        total = mass[:, -1]
        u = (u * total)[:, None]
        b = torch.searchsorted(mass, u) - 1
        inside = blocks[torch.arange(B, device=z.device), b[:, 0]].double().cumsum(-1)
        # clamped: the block's own sum may fall a bit short of its float64 mass
        j = torch.searchsorted(inside,
                               torch.minimum(u - mass.gather(1, b), inside[:, -1:]))
        tokens = (b * block + j)[:, 0]
    logp = z.gather(-1, tokens[:, None])[:, 0] - m[:, 0] - total.log().float()
    return tokens, logp

# -----------------------------------------------------------------------------
# the decode step


def cut_point(seed, key, think_budget):
    """Where a thinking row is interrupted (forced interruption, section 4): uniform over the last
    ~1/6 of the thinking budget, a function of (seed, key) alone, so a row restarted or moved to
    another slot is cut at the same token."""
    return random.Random(f"{seed}-{key}").randint(think_budget - think_budget // 6, think_budget)


def bucket_sizes(cap, smallest):
    """Powers of two from smallest, and cap: step sizes, so there are few CUDA graphs to capture."""
    return [2 ** i for i in range(smallest.bit_length() - 1, cap.bit_length())
            if smallest <= 2 ** i < cap] + [cap]


def bucket(n, sizes):
    return next(s for s in sizes if s >= n)


def len_bucket(n, cap):
    """n rounded up by at most 15 or n/8 (n an int or an array), so a step's plan recurs."""
    step = np.maximum(16, 1 << np.maximum(0, np.frexp(n)[1] - 4))  # frexp: n's bit length
    return np.minimum(-(-n // step) * step, cap)


def row_groups(lengths, cap, slack=1.2, floor=256):
    """Rows grouped by key length, neighbours merged while the keys read stay within slack x the
    rows' -> (rows, keys read: the group's longest row, masked: rows of fewer keys in it). Where
    no paged kernel runs, a row reads keys up to its group's length, not the longest row's; fewer
    groups are fewer attention calls."""
    n = np.maximum(np.asarray(lengths, dtype=np.int64), 1)
    if len(n) * len_bucket(n.max(), cap) <= slack * np.maximum(n, floor).sum():  # one group fits
        return ((slice(0, len(n)), int(n.max()), bool(n.min() < n.max())),)
    sizes, which = np.unique(len_bucket(n, cap), return_inverse=True)  # numpy: a step's host cost
    groups = [(int(S), np.flatnonzero(which == i).tolist()) for i, S in enumerate(sizes)]
    room = slack * np.maximum(n, floor).sum() - sum(S * len(rs) for S, rs in groups)
    while len(groups) > 1:
        cost, i = min(((groups[i + 1][0] - S) * len(rs), i)
                      for i, (S, rs) in enumerate(groups[:-1]))
        if cost > room:
            break
        room -= cost
        groups[i:i + 2] = [(groups[i + 1][0], sorted(groups[i][1] + groups[i + 1][1]))]
    out = []
    for _, rs in groups:
        S, short = int(n[rs].max()), bool((n[rs] < n[rs].max()).any())
        # consecutive rows as a slice: a view, not a gather
        out.append((slice(rs[0], rs[-1] + 1) if rs[-1] - rs[0] + 1 == len(rs) else tuple(rs), S,
                    short))
    return tuple(out)


def prefill_width(length, max_len):
    return min(-(-(length - 1) // 16) * 16, max_len)


def prefill_groups(lens, budget, max_len):
    """Prompts grouped into prefills of at most `budget` padded tokens."""
    groups, a = [], 0
    while a < len(lens):
        b, top = a + 1, lens[a]
        while b < len(lens) and (b + 1 - a) * prefill_width(max(top, lens[b]), max_len) <= budget:
            top, b = max(top, lens[b]), b + 1
        groups.append((a, b, prefill_width(top, max_len)))
        a = b
    return groups


class Decoder:
    """The sampler's device side: KV cache, slot state as (slots,) tensors, decode step.

    A step has no host sync; rows not live write only where a live row rewrites before reading. New
    weights are copied into the same storage, their copies refreshed in place (new_weights), so a
    captured graph reads them."""

    def __init__(self, model, slots, max_len, max_new, *, eos_id, think_end, interrupt_ids,
                 think_budget, answer_budget, interrupt, temperature, fp32_head, seed,
                 version, graphs, prefill_tokens=PREFILL_TOKENS, blocks=None, block=BLOCK):
        dev = next(model.parameters()).device
        self.model, self.max_len, self.device = model, max_len, dev
        self.think_budget, self.answer_budget = think_budget, answer_budget
        self.interrupt, self.temperature, self.seed = interrupt, temperature, seed
        self.prefill_tokens = prefill_tokens
        self.eos = torch.tensor(eos_id, dtype=torch.long, device=dev).view(-1)
        self.think_end = torch.tensor(think_end, dtype=torch.long, device=dev)
        self.phrase = torch.tensor(interrupt_ids or [0], dtype=torch.long, device=dev)
        block = kv_block(dev.type, max_len, block)
        width, self.block = -(-max_len // block), block
        blocks = min(blocks or 1 + slots * width, 1 + slots * width)  # at most: all at max_len
        if blocks < 1 + width:
            raise ValueError(f"a KV pool of {blocks} blocks of {block} tokens cannot hold one row "
                             f"of {max_len} tokens and the scratch block")
        self.cache = new_cache(model, blocks, block)
        # each slot's blocks; 0, the scratch block, where it holds none: rows not live write there.
        # The host's copy (tables) is the truth, so taking and freeing blocks needs no device sync;
        # the device's (table) is refreshed before the next forward.
        self.table = torch.zeros(slots, width, dtype=torch.int32, device=dev)
        self.tables, self.held = np.zeros((slots, width), np.int32), np.zeros(slots, int)
        self.free, self.stale = list(range(1, blocks)), False  # a heap: the lowest block first
        self.qkv = fused_qkv(model)
        self.kernel = decode_kernel(dev, self.cache[0][0].dtype, head_dim_of(model.config), block)
        w = model.lm_head.weight
        # the float32 head on tensor cores (bf16 in, float32 out) on CUDA, as the trainer's; no copy
        self.w16 = w.detach() if tensor_core_head(dev.type, w.dtype, fp32_head) else None
        self.weight = w.detach() if self.w16 is not None else head_weight(model, fp32_head).detach()
        long = lambda: torch.zeros(slots, dtype=torch.long, device=dev)
        flag = lambda: torch.zeros(slots, dtype=torch.bool, device=dev)
        self.rope = rope_tables(model, max_len)
        self.last, self.pos, self.n, self.cut, self.limit, self.finish = (long() for _ in range(6))
        # off: no row live, for the warm-up step before a graph capture (no row advances)
        self.live, self.thinking, self.interrupted, self.off = flag(), flag(), flag(), flag()
        self.cols = cols = max_new + 1  # spare column for rows not live
        self.tokens = torch.zeros(slots, cols, dtype=torch.long, device=dev)
        self.logps = torch.zeros(slots, cols, dtype=torch.promote_types(w.dtype, torch.float32),
                                 device=dev)
        self.mask = torch.ones(slots, cols, dtype=torch.bool, device=dev)
        self.versions = torch.zeros(slots, cols, dtype=torch.long, device=dev)
        # a row's uniforms, one per column, drawn at admission from (seed, key): a sample is a
        # function of its key, whatever its slot, batch or restarts
        self.noise = torch.full((slots, cols), 0.5, dtype=torch.float64, device=dev)
        self.version = torch.tensor(version, device=dev)  # a tensor: a graph replay reads it
        self.graphs = {} if graphs else None
        self.pool = torch.cuda.graph_pool_handle() if graphs else None

    def new_weights(self, version):
        """An in-flight update (PipelineRL, section 3.1): the rows go on under the new weights,
        their KV cache, computed by the old ones, kept; the following tokens carry the new
        version."""
        self.version.fill_(version)
        fused_qkv(self.model, into=self.qkv)
        if self.weight.data_ptr() != self.model.lm_head.weight.data_ptr():  # a float32 copy
            self.weight.copy_(self.model.lm_head.weight)

    def reserve(self, slot, length):
        """Blocks for the slot's first `length` tokens -> False, none taken, if too few are free.
        Paged KV (as vLLM): a row takes blocks as it grows, so the pool is sized for rows at their
        mean length, not every row at max_len."""
        need = -(-length // self.block) - self.held[slot]
        if need > len(self.free):
            return False
        for i in range(self.held[slot], self.held[slot] + max(need, 0)):
            self.tables[slot, i], self.stale = heapq.heappop(self.free), True
        self.held[slot] += max(need, 0)
        return True

    def release(self, slots):
        """Stop these rows (finished or preempted); their blocks back to the pool."""
        for s in slots:
            for b in self.tables[s, :self.held[s]].tolist():
                heapq.heappush(self.free, b)
            self.tables[s], self.held[s], self.stale = 0, 0, True
        self.live[torch.tensor(slots, device=self.device)] = False

    def _tables(self):
        if self.stale:
            self.table.copy_(torch.from_numpy(self.tables))
            self.stale = False

    def prefill(self, slots, prompts):
        """The prompts' keys but the last token's: that token is the first decode step's input."""
        self._tables()
        for a, b, width in prefill_groups([len(p) for p in prompts], self.prefill_tokens,
                                          self.max_len):
            if width:
                ids = torch.tensor([p[:-1] + [0] * (width + 1 - len(p)) for p in prompts[a:b]],
                                   device=self.device)
                forward(self.model, ids,
                        torch.arange(width, device=self.device).expand(b - a, width), self.cache,
                        self.rope, self.qkv, self.table,
                        rows=torch.tensor(slots[a:b], device=self.device))

    def admit(self, slots, prompts, keys):
        dev, lens = self.device, [len(p) for p in prompts]
        rows = torch.tensor(slots, device=dev)
        self.prefill(slots, prompts)
        cut = [cut_point(self.seed, k, self.think_budget) if self.interrupt else self.max_len
               for k in keys]  # max_len: never reached
        state = torch.tensor([[p[-1] for p in prompts], [m - 1 for m in lens], keys, cut],
                             device=dev)
        self.last[rows], self.pos[rows], self.cut[rows] = state[0], state[1], state[3]
        self.noise[rows] = uniforms(noise_stream(self.seed, state[2])[:, None],
                                    torch.arange(self.cols, device=dev))
        # limit: the whole budget, cut to n + answer_budget where thinking ends (_step)
        self.n[rows], self.limit[rows], self.finish[rows] = (
            0, self.think_budget + self.answer_budget, 0)
        self.live[rows], self.thinking[rows], self.interrupted[rows] = True, True, False

    def attention_plan(self, lengths):
        """How this step's attention reads each row's keys (attention_inputs); with R, a CUDA
        graph's key."""
        if self.kernel == "groups":
            return "groups", tuple((rows, S, masked, self.first_block(rows, S))
                                   for rows, S, masked in row_groups(lengths, self.max_len))
        return (self.kernel,)

    def first_block(self, rows, S):
        """The first of the blocks of rows a..b whose S keys lie in consecutive blocks, one a row
        (as a pool that holds every row lends them: the lowest free block first), else 0."""
        if not isinstance(rows, slice) or S > self.block:
            return 0
        first = self.tables[rows, 0]
        return int(first[0]) if first[0] and (np.diff(first) == 1).all() else 0

    def step(self, R, lengths):
        """One decode step of rows 0..R-1: a CUDA graph replay, else eager."""
        plan = self.attention_plan(lengths)
        self._tables()
        if self.graphs is None:
            return self._step(R, plan, self.live[:R])
        # a graph per (rows, plan): a decode step is many small kernels, their launches saved
        graph = self.graphs.get((R, plan))
        if graph is None:
            stream = torch.cuda.Stream()  # warm up off the capture
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._step(R, plan, self.off[:R])
            torch.cuda.current_stream().wait_stream(stream)
            graph = self.graphs[(R, plan)] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._step(R, plan, self.live[:R])
        graph.replay()

    def _step(self, R, plan, live):
        n, pos, limit, interrupted = self.n[:R], self.pos[:R], self.limit[:R], self.interrupted[:R]
        how = attention_inputs(plan, pos, self.cache[0][0].dtype, self.table[:R], self.block)
        hidden = forward(self.model, self.last[:R, None], pos[:, None], self.cache, self.rope,
                         self.qkv, self.table, how=how)[:, 0]
        logits = (mm32(hidden.to(self.w16.dtype), self.w16.t()) if self.w16 is not None
                  else logits_of(hidden, self.weight))
        tok, logp = sample(logits, self.temperature,  # token n's uniform, fixed at admission
                           self.noise[:R].gather(1, n[:, None])[:, 0])
        col = n[:, None]
        # forced interruption (section 4): from its cut point a thinking row is fed the phrase,
        # tokens it did not sample: out of the loss (mask 0), log-prob 0
        if self.interrupt:
            P, thinking, at = self.phrase.numel(), self.thinking[:R], n - self.cut[:R]
            interrupted |= live & thinking & (at == 0)
            forced = interrupted & (at < P)
            tok = torch.where(forced, self.phrase[at.clamp(0, P - 1)], tok)
            logp = torch.where(forced, 0.0, logp)
            self.mask[:R].scatter_(1, col, ~forced[:, None])
        self.tokens[:R].scatter_(1, col, tok[:, None])
        self.logps[:R].scatter_(1, col, logp[:, None])
        # each token's policy version: after an in-flight update a row spans versions
        self.versions[:R].scatter_(1, col, self.version.expand(R, 1))
        eos = (tok[:, None] == self.eos).any(-1)
        if self.interrupt:
            pending = forced & (at < P - 1)  # the phrase runs to its end, an eos id in it or not
            eos &= ~pending
            E = self.think_end.numel()
            tail = self.tokens[:R].gather(
                1, (col - E + 1 + torch.arange(E, device=self.device)).clamp_min(0))
            said = (n + 1 >= E) & (tail == self.think_end).all(-1)  # the row closed its thinking
            ends = live & thinking & ~pending & ~eos & (forced | said)
            # thinking over: the answer gets its own budget from here
            limit.copy_(torch.where(ends, n + 1 + self.answer_budget, limit))
            thinking &= ~ends
            over = ~pending & (n + 1 >= limit)
        else:
            over = n + 1 >= limit
        # 1 + the index in FINISH (an eos after an interruption is "interrupted"); 0 running
        code = torch.where(eos, 1 + interrupted.long(), torch.where(over, 3, 0)) * live
        self.finish[:R] += code
        self.last[:R] = torch.where(live, tok, self.last[:R])
        n += live
        pos += live
        self.live[:R] &= code == 0  # a finished row stops here; the host sees it at collect

    def collect(self, R):
        """Finished rows -> {slot: Sample}, one host sync; their slots and blocks freed."""
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
# the continuous-batching loop


def cache_length(max_prompt_len, think_budget, answer_budget, interrupt_ids, interrupt=True):
    """-> (cache positions per slot, completion tokens per sample)."""
    max_new = think_budget + answer_budget + (len(interrupt_ids) if interrupt else 0)
    return max_prompt_len + max_new, max_new


def peak_blocks(lengths, tops, block):
    """The most KV blocks rows at `lengths` tokens hold at once if each grows a token a step up to
    its top, then frees its blocks: the worst case of every row reaching its top."""
    lengths, tops = np.asarray(lengths), np.maximum(tops, lengths)
    left = tops - lengths  # steps until each row ends
    at = np.minimum(lengths[None] + left[:, None], tops[None])  # every row's length as row i ends
    return int((-(-at // block) * (left[None] >= left[:, None])).sum(1).max(initial=0))


def make_room(dec, order, owner, bound, pending, ahead, max_len):
    """Blocks for the next `ahead` tokens of every busy row, oldest first; where they run out, the
    newest row gives its blocks back and waits again (vLLM's preemption by recompute): it restarts
    from its prompt with its key, so under the same weights it makes the same sample -> whether a
    row was preempted."""
    preempted = False
    short = (-(-np.minimum(bound + ahead, max_len) // dec.block) > dec.held).tolist()
    for s in [s for s in order if short[s]]:  # a reserve call only where one can do something
        while owner[s] and not dec.reserve(s, min(bound[s] + ahead, max_len)):
            last = order.pop()
            dec.release([last])
            pending.appendleft(owner[last])
            owner[last], bound[last], preempted = None, -1, True
    return preempted


def admissible(dec, order, owner, bound, pending, free, room, reach, sync_every, max_len):
    """The pending prompts admitted into `free` slots this round, their first blocks reserved.
    With a watermark (vLLM's rule): a new row only while the pool, less the watermark (`room`),
    holds every running row and it at the length the last samples reached (`reach`), so none is
    preempted to make room for it and its decoding thrown away."""
    items = []
    rows = [(bound[s], min(len(owner[s][0]) - 1 + reach, max_len))
            for s in (order if room and pending and free else ())]
    while pending and len(items) < len(free):
        m = len(pending[0][0]) - 1
        rows.append((m, min(m + reach, max_len)))
        if (room and len(rows) > 1 and peak_blocks(*zip(*rows), dec.block) > room
                or not dec.reserve(free[len(items)], min(m + sync_every, max_len))):
            break
        items.append(pending.popleft())
    return items


@torch.no_grad()
def sampler(model, *, eos_id, think_end, interrupt_ids, think_budget, answer_budget, max_prompt_len,
            interrupt=True, slots=64, temperature=1.0, fp32_head=True, seed=0, version=0,
            graphs=None, sync_every=None, prefill_tokens=PREFILL_TOKENS, blocks=None, block=BLOCK):
    """The continuous-batching sampler, a generator the caller drives (a finished row's slot takes
    the next prompt at the next send, not at the end of a batch):

        steps = sampler(model, ...)
        finished, n_free = next(steps)
        finished, n_free = steps.send((new, version))   # sync_every steps

    new: [(prompt ids, noise key, tag)]; version: the weights' policy version (copied in between
    sends); finished: [(tag, Sample)]. data.special_tokens gives eos_id, think_end,
    interrupt_ids. blocks: the KV pool (plan.fit_slots; default all slots at the full budget)."""
    check_supported(model)
    if interrupt and not interrupt_ids:
        raise ValueError("interrupt=True needs the interruption phrase's token ids (interrupt_ids)")
    device = next(model.parameters()).device
    graphs = device.type == "cuda" if graphs is None else graphs
    # decode steps between host syncs (and weight updates): a sync drains the GPU's queue
    sync_every = (8 if device.type == "cuda" else 1) if sync_every is None else sync_every
    max_len, max_new = cache_length(max_prompt_len, think_budget, answer_budget, interrupt_ids,
                                    interrupt)
    dec = Decoder(model, slots, max_len, max_new, eos_id=eos_id, think_end=think_end,
                  interrupt_ids=interrupt_ids, think_budget=think_budget,
                  answer_budget=answer_budget, interrupt=interrupt, temperature=temperature,
                  fp32_head=fp32_head, seed=seed, version=version, graphs=graphs,
                  prefill_tokens=prefill_tokens, blocks=blocks, block=block)
    # step sizes: a CUDA graph each; eager steps run the busy rows alone
    row_sizes = bucket_sizes(slots, 8) if graphs else list(range(1, slots + 1))
    pending = deque()
    owner = [None] * slots  # (prompt, key, tag)
    order = []  # busy slots, oldest first: the newest is preempted first
    # a busy row's cache position, at most: the host sees rows finish only at collect (-1: free)
    bound = np.full(slots, -1)
    # admission's room: the pool less vLLM's watermark (1% of its blocks), None where it holds
    # every slot at max_len; rows projected to the longest of the last `slots` samples (the whole
    # budget until that many have finished)
    room = (None if len(dec.free) >= slots * -(-max_len // dec.block) else
            len(dec.free) - len(dec.free) // 100)
    recent = deque([max_new], maxlen=slots)
    finished = []
    while True:
        new, new_version = yield finished, owner.count(None) - len(pending)
        finished = []
        for p, key, tag in new:
            if not 0 < len(p) <= max_prompt_len:
                raise ValueError(f"prompt of {len(p)} tokens: a prompt needs 1 to "
                                 f"max_prompt_len = {max_prompt_len}")
            pending.append((p, key, tag))
        if new_version != version:  # in-flight update (PipelineRL, section 3.1): the cache stays
            version = new_version
            dec.new_weights(version)
        preempted = make_room(dec, order, owner, bound, pending, sync_every, max_len)
        free = [s for s in range(slots) if owner[s] is None]
        # none admitted in a round that preempted a row (they would take the blocks it gave back)
        items = [] if preempted else admissible(dec, order, owner, bound, pending, free, room,
                                                max(recent), sync_every, max_len)
        if items:
            dec.admit(free[:len(items)], [p for p, _, _ in items], [key for _, key, _ in items])
            for s, item in zip(free, items):
                owner[s], bound[s] = item, len(item[0]) - 1
                order.append(s)
        busy = [s for s in range(slots) if owner[s] is not None]
        if not busy:
            continue
        # the step runs rows 0..R-1: free slots fill lowest first, so busy rows stay low
        R = bucket(busy[-1] + 1, row_sizes)
        for _ in range(sync_every):
            dec.step(R, bound[:R] + 1)
            bound[busy] = np.minimum(bound[busy] + 1, max_len - 1)
        for s, sample in dec.collect(R).items():
            (_, sample.key, tag), owner[s], bound[s] = owner[s], None, -1
            order.remove(s)
            recent.append(len(sample.tokens))
            finished.append((tag, sample))


def drive(steps, items, version=0, stop=None, progress=None):
    """Run a sampler not yet started over `items` [(prompt ids, noise key, tag)] until every one
    is finished -> {tag: Sample}; None once stop() is true. progress(n finished) after each send."""
    next(steps)
    out, new = {}, items
    while len(out) < len(items):
        if stop is not None and stop():
            steps.close()
            return None
        finished, _ = steps.send((new, version))
        new = []
        out.update(finished)
        if progress is not None:
            progress(len(out))
    steps.close()
    return out


def generate(model, prompts, *, keys=None, slots=64, version=0, stop=None, max_prompt_len=None,
             **settings):
    """One Sample per prompt, or None once stop() is true. keys: noise keys (default 0..n-1)."""
    keys = range(len(prompts)) if keys is None else keys
    max_prompt_len = max_prompt_len or max(map(len, prompts), default=1)
    steps = sampler(model, slots=min(slots, len(prompts)), max_prompt_len=max_prompt_len,
                    version=version, **settings)
    done = drive(steps, list(zip(prompts, keys, range(len(prompts)))), version, stop)
    return None if done is None else [done[i] for i in range(len(prompts))]


if __name__ == "__main__":
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from checks import checked_prompt_ids
    import config
    from data import completion_text, special_tokens
    from toy import toy_model_dir, toy_problems
    from hub import hide_progress_bars, resolve_model
    from faults import pick_threads
    from runs import check_model_files

    args = config.sample_parser(__doc__.split("\n\n")[0]).parse_args()
    hide_progress_bars()
    pick_threads()
    try:
        path = resolve_model(args.model) if args.model else toy_model_dir()
        check_model_files(path)
    except (ValueError, OSError) as err:
        sys.exit(f"error: --model {err}")
    tokenizer, model = (AutoTokenizer.from_pretrained(path, trust_remote_code=False),
                        AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False).eval())
    problems = [{"prompt": args.prompt}] if args.prompt else toy_problems(3, 0)
    try:  # the checks of train.py's prompts
        ids = checked_prompt_ids(args, tokenizer, model, problems)
    except ValueError as err:
        sys.exit(f"error: --model {path}: {err}")
    problems, prompts = [p["prompt"] for p in problems for _ in range(args.n)], \
        [i for i in ids for _ in range(args.n)]
    out = generate(model, prompts, **special_tokens(tokenizer, model),
                   think_budget=args.think_budget, answer_budget=args.answer_budget,
                   temperature=args.temperature, seed=args.seed)
    for p, s in zip(problems, out):
        print(f"{p!r} -> [{s.finish}] {completion_text(tokenizer, s)!r}")
