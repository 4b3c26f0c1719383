"""
paged_attention.py: the sampler's decode attention, each row over its own keys through its block
table (the KV pool of generate.new_cache): which kernel runs where, and how it is called.

Start at `decode_kernel`: off CUDA "groups" (rows grouped by length, SDPA per group); on CUDA the
first of flash-attn's `flash_attn_with_kvcache`, torch's `varlen_attn` (where it takes block_table)
and `paged_decode` (Triton, below) that runs and matches SDPA, else a one-line error saying what to
install; there is no dense fallback. `decode_attention` runs it on a step's `attention_inputs`.

`paged_decode`, the kernel of our own: one program per (row, KV head), the query heads sharing that
KV head (GQA) one tile, an online softmax (FlashAttention's running max and sum) over the row's
keys through its block table. On CPU it runs through Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported).
"""

import contextlib
import inspect

import torch
import torch.nn.functional as F

try:  # torch's CUDA build ships triton
    import triton
    import triton.language as tl
except ImportError:
    triton = None
try:
    from flash_attn import flash_attn_with_kvcache
except Exception:
    flash_attn_with_kvcache = None
varlen_attn = None
if torch.cuda.is_available():  # CUDA's alone: its import pulls torch's compiler (~1 s a start)
    with contextlib.suppress(ImportError):
        from torch.nn.attention.varlen import varlen_attn

_KERNELS = {}
PAGED = ("flash", "varlen", "triton")  # CUDA's decode attention, in order of preference


def decode_kernel(device, dtype, head_dim, block):
    """Off CUDA "groups"; on CUDA the first paged kernel that runs and matches SDPA (checked once,
    exact_kernel), else a one-line error saying what to install."""
    if device.type != "cuda":
        return "groups"
    key = (str(device), dtype, head_dim, block)
    if key not in _KERNELS:
        _KERNELS[key], why = exact_kernel(device, dtype, head_dim, block)
        if _KERNELS[key] is None:
            del _KERNELS[key]
            raise RuntimeError(f"paged_attention.py: no paged decode attention runs on {device} "
                               f"in {dtype} ({'; '.join(why)}): pip install triton (torch's "
                               f"CUDA build ships it) or flash-attn")
    return _KERNELS[key]


def exact_kernel(device, dtype, head_dim, block):
    """-> (the first of PAGED that runs here and matches SDPA over each row's own keys (rows of
    up to two blocks, GQA), or None; why each one before it did not)."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(3 + 2 * (n > 1), n, h, head_dim, generator=g, device=device,
                           dtype=dtype)
               for n, h in ((1, 4), (block, 2), (block, 2)))  # a pool of 5 blocks
    pos = torch.tensor([0, block + block // 2, 2 * block - 1], device=device)
    table = torch.tensor([[2, 4], [3, 1], [4, 2]], dtype=torch.int32, device=device)
    ref = decode_attention(q, k, v, 0.125, attention_inputs(
        ("groups", ((slice(0, 3), 2 * block, True, 0),)), pos, dtype, table, block))
    missing = {"flash": flash_attn_with_kvcache is None and "flash-attn not installed",
               "varlen": (varlen_attn is None or "block_table" not in
                          inspect.signature(varlen_attn).parameters)
               and f"torch {torch.__version__}'s varlen_attn takes no block_table",
               "triton": triton is None and "triton not installed"}
    why = []
    for kernel in PAGED:
        if missing[kernel]:
            why.append(missing[kernel])
            continue
        try:
            out = decode_attention(q, k, v, 0.125,
                                   attention_inputs((kernel,), pos, dtype, table, block))
        except Exception as err:
            why.append(f"{kernel}: {type(err).__name__}: {(str(err) or '?').splitlines()[0][:120]}")
            continue
        if torch.allclose(out.float(), ref.float(), atol=2e-2):
            return kernel, why
        why.append(f"{kernel}: differs from SDPA")
    return None, why


def attention_inputs(plan, pos, dtype, table, block):
    """A step's plan (generate.Decoder.attention_plan) as its kernel's inputs; pos: each row's
    position (its key count - 1)."""
    if plan[0] in ("flash", "triton"):
        return plan[0], (pos + 1).int(), table
    if plan[0] == "varlen":
        lengths = (pos + 1).int()
        cu = torch.arange(pos.size(0) + 1, dtype=torch.int32, device=pos.device)
        return "varlen", lengths, table, cu, F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))

    def keys(t, S):  # (n, S) flat positions of the first S keys of rows with tables t
        return flat_positions(t, torch.arange(S, device=pos.device).expand(t.size(0), S), block)

    def mask(p, S):
        return torch.zeros(p.size(0), 1, 1, S, dtype=dtype, device=pos.device).masked_fill_(
            torch.arange(S, device=pos.device) > p[:, None, None, None], float("-inf"))
    groups = []
    for rows, S, masked, first in plan[1]:
        if not isinstance(rows, slice):
            rows = torch.tensor(rows, device=pos.device)
        # rows in consecutive blocks, one each: their keys a view of the pool, not a gather
        at = ((slice(first, first + rows.stop - rows.start), slice(0, S)) if first else
              keys(table[rows], S))
        groups.append((rows, at, mask(pos[rows], S) if masked else None))
    return "groups", groups


def decode_attention(q, k_cache, v_cache, scale, how):
    """Decode attention, each row over its own keys through its block table (attention_inputs)."""
    R, _, H, D = q.shape
    Hkv = k_cache.shape[2]
    if how[0] == "flash":
        return flash_attn_with_kvcache(q.contiguous(), k_cache, v_cache, cache_seqlens=how[1],
                                       block_table=how[2], softmax_scale=scale)[:, 0]
    if how[0] == "varlen":  # cumulative lengths of queries (one a row) and keys, both
        return varlen_attn(q[:, 0].contiguous(), k_cache, v_cache, how[3], how[4], 1,
                           how[2].size(1) * k_cache.size(1), scale=scale, enable_gqa=True,
                           seqused_k=how[1], block_table=how[2])
    if how[0] == "triton":
        return paged_decode(q[:, 0], k_cache, v_cache, how[1], how[2], scale)
    pool = k_cache, v_cache
    k_cache, v_cache = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)  # by flat position

    def sdpa(q, k, v, mask):
        out = F.scaled_dot_product_attention(q.reshape(-1, Hkv, H // Hkv, D), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=mask, scale=scale)
        return out.reshape(-1, H, D)
    out = None if len(how[1]) == 1 else q.new_empty(R, H, D)  # None: one group, every row
    for rows, at, mask in how[1]:
        k, v = (c[at] for c in (pool if isinstance(at, tuple) else (k_cache, v_cache)))
        if out is None:
            return sdpa(q, k, v, mask)
        if isinstance(rows, slice):
            out[rows] = sdpa(q[rows], k, v, mask)
        else:
            out.index_copy_(0, rows, sdpa(q[rows], k, v, mask))
    return out


def flat_positions(table, pos, block):
    """Flat pool positions of tokens pos (R, T) of rows with block tables table (R, W)."""
    return table.gather(1, pos // block).long() * block + pos % block

# -----------------------------------------------------------------------------
# the paged kernel in Triton


def _pow2(n, least=16):
    """n rounded up to a power of two, at least `least` (tl.dot's smallest tile side)."""
    return max(least, 1 << (n - 1).bit_length())


if triton is not None:
    @triton.jit
    def _paged_decode(q, k, v, lengths, table, out, scale, q_row, q_head, table_row,
                      BLOCK: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                      GP: tl.constexpr, DP: tl.constexpr, N: tl.constexpr, PRECISION: tl.constexpr):
        row, kv = tl.program_id(0), tl.program_id(1)
        g, d, n = tl.arange(0, GP), tl.arange(0, DP), tl.arange(0, N)
        heads = kv * G + g  # the query heads of KV head kv (rows past G are padding)
        qmask = (g < G)[:, None] & (d < D)[None, :]
        qt = tl.load(q + row * q_row + heads[:, None] * q_head + d[None, :], mask=qmask,
                     other=0.0).to(tl.float32)
        m = tl.full([GP], float("-inf"), tl.float32)  # running max of the scores
        s_sum = tl.zeros([GP], tl.float32)  # running sum of exp(score - m)
        acc = tl.zeros([GP, DP], tl.float32)
        L = tl.load(lengths + row)
        for start in range(0, L, N):
            t = start + n  # the row's token positions; token t is in block table[row, t // BLOCK]
            inside = t < L
            page = tl.load(table + row * table_row + t // BLOCK, mask=inside, other=0).to(tl.int64)
            at = ((page * BLOCK + t % BLOCK) * HKV + kv) * D
            kvmask = inside[:, None] & (d < D)[None, :]
            # float32 tiles. 16-bit keys and queries are exact in tf32 (10 mantissa bits): the
            # scores are SDPA's float32 ones, on tensor cores; the weights p round to tf32
            kt = tl.load(k + at[:, None] + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
            vt = tl.load(v + at[:, None] + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
            s = tl.dot(qt, tl.trans(kt), input_precision=PRECISION) * scale
            s = tl.where(inside[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)  # rescales what was summed under the old max
            p = tl.exp(s - m_new[:, None])
            s_sum = s_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision=PRECISION)
            m = m_new
        o = acc / s_sum[:, None]
        tl.store(out + row * q_row + heads[:, None] * q_head + d[None, :],
                 o.to(out.dtype.element_ty), mask=qmask)


def paged_decode(q, k_cache, v_cache, lengths, table, scale, keys_at_once=64):
    """q (R, H, D) over each row's first lengths[r] keys of the pools k_cache, v_cache
    (blocks, block, Hkv, D) through its block table table (R, W) -> (R, H, D)."""
    R, H, D = q.shape
    _, block, Hkv, _ = k_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    tf32 = q.dtype in (torch.float16, torch.bfloat16)
    _paged_decode[(R, Hkv)](q, k_cache, v_cache, lengths, table, out, scale, q.stride(0),
                            q.stride(1), table.stride(0), BLOCK=block, HKV=Hkv, G=H // Hkv, D=D,
                            GP=_pow2(H // Hkv), DP=_pow2(D), N=keys_at_once,
                            PRECISION="tf32" if tf32 else "ieee")
    return out
