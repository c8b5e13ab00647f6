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
def rope_and_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, at_ptr, q_out_ptr,
                          C, q_row, k_row, v_row, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, D)
    partner = (offs + D // 2) % D  # roll(x, D/2)[i] = x[(i + D/2) mod D]
    cos = tl.load(cos_ptr + b * D + offs).to(tl.float32)
    sin = tl.load(sin_ptr + b * D + offs).to(tl.float32)  # signed: (-sin1, sin2)
    if head < H:
        src = q_ptr + b * q_row + head * D
    else:
        src = k_ptr + b * k_row + (head - H) * D
    x = tl.load(src + offs)
    kind = x.dtype
    first = (x.to(tl.float32) * cos).to(kind)  # x * cos, rounded as torch's product
    out = (first.to(tl.float32) + tl.load(src + partner).to(tl.float32) * sin).to(kind)  # addcmul: one rounding
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
def _online(m, s, x):
    # One block into per-lane running max m and sum s = sum exp(x - m) (Milakov & Gimelshein 2018): the sum
    # rescaled when m grows; a lane that has seen only -inf keeps s = 0.
    new = tl.maximum(m, x)
    s = s * tl.where(new == float("-inf"), 1.0, tl.exp(m - new)) + tl.where(x == float("-inf"), 0.0,
                                                                            tl.exp(x - new))
    return new, s


@triton.jit
def _lanes_total(m, s):
    # The row's max and sum exp(x - max) from the lanes' running ones.
    top = tl.max(m, axis=0)
    return top, tl.sum(s * tl.where(m == float("-inf"), 0.0, tl.exp(m - top)), axis=0)


@triton.jit
def draw_kernel(logits_ptr, row_stride, u_ptr, u_row_stride, t_ptr, eos_ptr, ban_until, temperature, sums_ptr,
                token_ptr, logp_ptr, V: tl.constexpr, NBLOCKS: tl.constexpr, N_EOS: tl.constexpr,
                SCALED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    lanes = tl.arange(0, BLOCK)
    t = tl.load(t_ptr)
    banned = t < ban_until
    # 1. Online max and sum of exp of the scaled logits x (the log-prob's normaliser) and of z (the draw's).
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    sx = tl.zeros([BLOCK], tl.float32)
    mz = tl.full([BLOCK], float("-inf"), tl.float32)
    sz = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        x, z = _scaled_and_drawn(base, start + lanes, V, temperature, eos_ptr, banned, N_EOS, SCALED)
        mx, sx = _online(mx, sx, x)
        mz, sz = _online(mz, sz, z)
    top_x, sum_x = _lanes_total(mx, sx)
    top_z, sum_z = _lanes_total(mz, sz)
    # 2. softmax(z) summed per block of BLOCK tokens in float32, the blocks accumulated in float64.
    total = tl.zeros([], tl.float64)
    for b in range(0, NBLOCKS):
        _, z = _scaled_and_drawn(base, b * BLOCK + lanes, V, temperature, eos_ptr, banned, N_EOS, SCALED)
        block_sum = tl.sum(tl.where(z == float("-inf"), 0.0, tl.exp(z - top_z) / sum_z), axis=0)
        tl.store(sums_ptr + row * NBLOCKS + b, block_sum)
        total += block_sum.to(tl.float64)
    # 3. The first block whose cumulative sum exceeds u * total (the last where none does).
    target = tl.load(u_ptr + row * u_row_stride + t) * total
    cdf = tl.zeros([], tl.float64)
    chosen_block = tl.zeros([], tl.int32) + NBLOCKS - 1
    before = tl.zeros([], tl.float64)
    last_before = tl.zeros([], tl.float64)
    found = tl.zeros([], tl.int32)
    for b in range(0, NBLOCKS):
        nxt = cdf + tl.load(sums_ptr + row * NBLOCKS + b).to(tl.float64)
        first = (found == 0) & (nxt > target)
        chosen_block = tl.where(first, b, chosen_block)
        before = tl.where(first, cdf, before)
        found = tl.where(first, 1, found)
        last_before = cdf
        cdf = nxt
    before = tl.where(found == 1, before, last_before)
    # 4. Within it, the first token whose float64 running sum exceeds the rest of the target, kept under the
    #    block's own total (its sum in another order): the number of running sums <= the rest.
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
