"""The Triton kernels of `tidyrl.models.fused_decode` (which launches them; read it first). A module of its own,
imported only where Triton is (CUDA builds of torch bring it): a kernel's helpers must be module globals, which is
where Triton's interpreter (the CPU tests) looks them up. `fused_decode._kernels` imports it, again after its
cache is cleared, so that the kernels are decorated under TRITON_INTERPRET as it is then."""

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, eps, N: tl.constexpr,
                        HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=inside, other=0.0)
    if HAS_DELTA:  # x + delta as torch adds two bf16 tensors: in float32, one rounding
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * N + offs, mask=inside, other=0.0).to(tl.float32)
             ).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * N + offs, x, mask=inside)
    v = x.to(tl.float32)
    normed = (v / tl.sqrt(tl.sum(v * v, axis=0) / N + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + offs, mask=inside, other=0.0)
    tl.store(out_ptr + row * N + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=inside)


@triton.jit
def silu_and_mul_kernel(gate_up_ptr, out_ptr, row_stride, I: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < I
    gate = tl.load(gate_up_ptr + row * row_stride + offs, mask=inside, other=0.0)
    up = tl.load(gate_up_ptr + row * row_stride + I + offs, mask=inside, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu: x / (1 + exp(-x)) in float32, rounded
    tl.store(out_ptr + row * I + offs, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=inside)


@triton.jit
def _rope_factors(cos_ptr, sin_ptr, b, D: tl.constexpr):
    # Row b's rope factors in float32, (D,) each, the sine signed (-sin1, sin2); and each lane's partner,
    # roll(x, D/2)[i] = x[(i + D/2) mod D].
    d = tl.arange(0, D)
    return (d, (d + D // 2) % D, tl.load(cos_ptr + b * D + d).to(tl.float32),
            tl.load(sin_ptr + b * D + d).to(tl.float32))


@triton.jit
def _roped(x, x_partner, cos, sin):
    # RoFormer eq. 34 rounded as `lean_layer.rope`: x * cos rounded as torch's product, plus roll(x) * signed sin
    # in one rounding (addcmul); in x's dtype.
    kind = x.dtype
    return ((x.to(tl.float32) * cos).to(kind).to(tl.float32) + x_partner.to(tl.float32) * sin).to(kind)


@triton.jit
def rope_and_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, at_ptr, q_out_ptr,
                          C, q_row, k_row, v_row, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs, partner, cos, sin = _rope_factors(cos_ptr, sin_ptr, b, D)
    if head < H:
        src = q_ptr + b * q_row + head * D
    else:
        src = k_ptr + b * k_row + (head - H) * D
    out = _roped(tl.load(src + offs), tl.load(src + partner), cos, sin)
    if head < H:
        tl.store(q_out_ptr + (b * H + head) * D + offs, out)
    else:
        g = head - H
        slot = ((b * HKV + g) * C + tl.load(at_ptr)) * D
        tl.store(keys_ptr + slot + offs, out)
        tl.store(values_ptr + slot + offs, tl.load(v_ptr + b * v_row + g * D + offs))


@triton.jit
def _scaled_and_drawn(base, offs, V, temperature, eos_ptr, banned, N_EOS: tl.constexpr, SCALED: tl.constexpr):
    # x: the logits at `offs` in float32 (-inf past V) over the temperature, as torch's `logits.float() / t`;
    # z: x with the EOS ids at -inf while banned (what a token is drawn from).
    x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    if SCALED:
        x = x / temperature
    hit = offs < 0
    for i in range(N_EOS):
        hit = hit | (offs == tl.load(eos_ptr + i))
    return x, tl.where(hit & banned, float("-inf"), x)


@triton.jit
def _block_max_and_sum(x):
    # A block's max and sum exp(x - max); 0 for a block all at -inf.
    top = tl.max(x, axis=0)
    return top, tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - top)), axis=0)


@triton.jit
def _row_max_and_sum(partials_ptr, row, which, NBLOCKS: tl.constexpr, NB_P2: tl.constexpr):
    # The row's max and sum exp(. - max) from its blocks' (`which`: 0 the scaled logits x, 2 the drawn ones z).
    k = tl.arange(0, NB_P2)
    inside = k < NBLOCKS
    m = tl.load(partials_ptr + (row * NBLOCKS + k) * 4 + which, mask=inside, other=float("-inf"))
    s = tl.load(partials_ptr + (row * NBLOCKS + k) * 4 + which + 1, mask=inside, other=0.0)
    top = tl.max(m, axis=0)
    return top, tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - top)), axis=0)


# The draw in three kernels, each a grid wide enough to fill the GPU (one program per row and block of the sampler,
# then one per row), where one program per row walked 150k logits three times in a loop:
# 1. per block: the max and sum of exp of the scaled logits x (the log-prob's normaliser) and of z (the draw's);
# 2. per block: softmax(z) summed over the block in float32, from the row's max and sum (combined from step 1's);
# 3. per row: the blocks' float64 cumulative sums, the block where u * total falls, the token within it, its log-prob.
@triton.jit
def draw_partials_kernel(logits_ptr, row_stride, t_ptr, eos_ptr, ban_until, temperature, partials_ptr,
                         V: tl.constexpr, NBLOCKS: tl.constexpr, N_EOS: tl.constexpr, SCALED: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    banned = tl.load(t_ptr) < ban_until
    x, z = _scaled_and_drawn(logits_ptr + row * row_stride, b * BLOCK + tl.arange(0, BLOCK), V, temperature, eos_ptr,
                             banned, N_EOS, SCALED)
    mx, sx = _block_max_and_sum(x)
    mz, sz = _block_max_and_sum(z)
    out = partials_ptr + (row * NBLOCKS + b) * 4
    tl.store(out, mx)
    tl.store(out + 1, sx)
    tl.store(out + 2, mz)
    tl.store(out + 3, sz)


@triton.jit
def draw_block_sums_kernel(logits_ptr, row_stride, t_ptr, eos_ptr, ban_until, temperature, partials_ptr, sums_ptr,
                           V: tl.constexpr, NBLOCKS: tl.constexpr, NB_P2: tl.constexpr, N_EOS: tl.constexpr,
                           SCALED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    banned = tl.load(t_ptr) < ban_until
    top_z, sum_z = _row_max_and_sum(partials_ptr, row, 2, NBLOCKS, NB_P2)
    _, z = _scaled_and_drawn(logits_ptr + row * row_stride, b * BLOCK + tl.arange(0, BLOCK), V, temperature, eos_ptr,
                             banned, N_EOS, SCALED)
    tl.store(sums_ptr + row * NBLOCKS + b,
             tl.sum(tl.where(z == float("-inf"), 0.0, tl.exp(z - top_z) / sum_z), axis=0))


@triton.jit
def draw_pick_kernel(logits_ptr, row_stride, u_ptr, u_row_stride, t_ptr, eos_ptr, ban_until, temperature,
                     partials_ptr, sums_ptr, token_ptr, logp_ptr, V: tl.constexpr, NBLOCKS: tl.constexpr,
                     NB_P2: tl.constexpr, N_EOS: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    t = tl.load(t_ptr)
    banned = t < ban_until
    top_x, sum_x = _row_max_and_sum(partials_ptr, row, 0, NBLOCKS, NB_P2)
    top_z, sum_z = _row_max_and_sum(partials_ptr, row, 2, NBLOCKS, NB_P2)
    # The first block whose float64 cumulative sum exceeds u * total (the last where none does): the number of
    # cumulative sums <= the target, as searchsorted(right=True) counts them.
    k = tl.arange(0, NB_P2)
    inside = k < NBLOCKS
    cdf = tl.cumsum(tl.load(sums_ptr + row * NBLOCKS + k, mask=inside, other=0.0).to(tl.float64), axis=0)
    total = tl.max(cdf, axis=0)  # (non-decreasing: the last)
    target = tl.load(u_ptr + row * u_row_stride + t) * total
    chosen_block = tl.minimum(tl.sum((inside & (cdf <= target)).to(tl.int32), axis=0), NBLOCKS - 1)
    before = tl.sum(tl.where(k == chosen_block - 1, cdf, 0.0), axis=0)
    # Within it, the first token whose float64 running sum exceeds the rest of the target, kept under the
    # block's own total (its sum in another order): the number of running sums <= the rest.
    lanes = tl.arange(0, BLOCK)
    _, z = _scaled_and_drawn(base, chosen_block * BLOCK + lanes, V, temperature, eos_ptr, banned, N_EOS, SCALED)
    inner = tl.cumsum(tl.where(z == float("-inf"), 0.0, tl.exp(z - top_z) / sum_z).to(tl.float64), axis=0)
    last = tl.max(inner, axis=0)
    below_last = tl.where(last > 0, (last.to(tl.int64, bitcast=True) - 1).to(tl.float64, bitcast=True), 0.0)
    rest = tl.minimum(target - before, below_last)
    token = tl.minimum(chosen_block * BLOCK + tl.sum((inner <= rest).to(tl.int32), axis=0), V - 1)
    # log softmax(x)[token], x unbanned: (x - max) - log(sum exp(x - max)), as torch's log_softmax.
    x_token = tl.load(base + token).to(tl.float32)
    if SCALED:
        x_token = x_token / temperature
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logp_ptr + row, (x_token - top_x) - tl.log(sum_x))


@triton.jit
def rope_cache_attend_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, at_ptr, bias_ptr, out_ptr,
                             C, q_row, k_row, v_row, bias_row, scale, R: tl.constexpr, R_P2: tl.constexpr,
                             HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program per row and key/value head g: rope of the group's R query heads and of its key (as in
    # rope_and_cache_kernel), the key and value written into the cache at `at`, then attention of the R queries
    # over the cache positions 0..at only (not the whole capacity C), in blocks of BLOCK_N with a running max and
    # sum (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, alg. 1): scores q.k * scale + bias in
    # float32, the probabilities rounded to the dtype for the product with the values, as the SDPA kernels do.
    # The products take float32 operands (tf32 on tensor cores): every operand is a bf16/fp16 value, which tf32
    # holds exactly, so they are the 16-bit products with float32 sums; and Triton's interpreter (the CPU tests)
    # computes 16-bit tl.dot wrongly.
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    d, partner, cos, sin = _rope_factors(cos_ptr, sin_ptr, b, D)
    at = tl.load(at_ptr)
    head = (b * HKV + g) * C * D  # the group's cache, (C, D)
    k_src = k_ptr + b * k_row + g * D
    k = _roped(tl.load(k_src + d), tl.load(k_src + partner), cos, sin)
    kind = k.dtype
    tl.store(keys_ptr + head + at * D + d, k)
    tl.store(values_ptr + head + at * D + d, tl.load(v_ptr + b * v_row + g * D + d))
    r = tl.arange(0, R_P2)[:, None]
    mine = r < R  # (R_P2 >= 16 rows for tl.dot; the ones past R are zeros, never stored)
    q_src = q_ptr + b * q_row + (g * R + r) * D
    q = _roped(tl.load(q_src + d[None, :], mask=mine, other=0.0),
               tl.load(q_src + partner[None, :], mask=mine, other=0.0), cos[None, :], sin[None, :])
    tl.debug_barrier()  # the key and value just stored, visible to every thread of this program before it reads them
    top = tl.full((R_P2,), float("-inf"), tl.float32)
    total = tl.zeros((R_P2,), tl.float32)
    acc = tl.zeros((R_P2, D), tl.float32)
    for start in range(0, at + 1, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        seen = n <= at
        keys = tl.load(keys_ptr + head + n[None, :] * D + d[:, None], mask=seen[None, :], other=0.0)  # (D, N)
        bias = tl.load(bias_ptr + b * bias_row + n, mask=seen, other=float("-inf")).to(tl.float32)
        s = tl.dot(q.to(tl.float32), keys.to(tl.float32)) * scale + bias[None, :]  # (R_P2, N)
        new_top = tl.maximum(top, tl.max(s, axis=1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # (a block all padding so far: nothing to add)
        p = tl.exp(s - shift[:, None])
        kept = tl.exp(top - shift)
        total = total * kept + tl.sum(p, axis=1)
        values = tl.load(values_ptr + head + n[:, None] * D + d[None, :], mask=seen[:, None], other=0.0)  # (N, D)
        acc = acc * kept[:, None] + tl.dot(p.to(kind).to(tl.float32), values.to(tl.float32))
        top = new_top
    tl.store(out_ptr + b * (HKV * R * D) + (g * R + r) * D + d[None, :], (acc / total[:, None]).to(kind), mask=mine)
