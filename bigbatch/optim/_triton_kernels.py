"""LAMB's and LARS's Triton kernels: every tensor of a bucket in one launch per pass.

Imported only through ``_triton_plan.kernels(device)``, which loads this file
compiled for CUDA tensors and, under ``TRITON_INTERPRET=1``, a second time
through Triton's interpreter for CPU tensors (the tests' path).

Multi-tensor layout. Each program takes one chunk (at most ``CHUNK``
elements in memory order) of one tensor: ``chunk_tensor[c]`` names the
tensor and ``chunk_start[c]`` where the chunk begins; the tensors' addresses
sit in ``ptrs``, one row per role (weights, gradients, each state), so one
launch covers any number of tensors, whatever their shapes. Tensors of one
role share the memory layout of their weight (``_triton_plan`` stages those
that do not), so walking raw memory pairs the right elements.

Norms without atomics. A first pass writes each chunk's partial sums of
squares to ``partials``; in the second pass every program of a tensor adds
that tensor's partials itself, in a fixed order (``_tensor_squares``), and
applies the trust ratio. Every program thus gets the same sums, bit for bit,
on every run. For DTensor shards ``reduce_chunks`` adds them once, per
tensor, so that they can be summed over the mesh before the second pass.

Per-tensor state between the passes. A tensor's first chunk (``start == 0``)
writes its scalar state, but other programs of the tensor read it, and
programs run in no fixed order. So the first pass's first chunk copies what
the second pass needs to ``scalars[t]`` (LAMB: the new step count; LARS: the
previous ``local_lr``), and only the second pass's first chunk writes the
state, which no program of that pass reads.

Scalars. Per-program rules (bias corrections, trust ratios, LARS's rates)
run in float64: float arguments are declared ``tl.float64`` and wrapped by
``_f64``, which makes a float64 scalar of either a compiled argument or the
interpreter's Python float. Elementwise work runs in ``C``: float32, or
float64 for float64 tensors.
"""

import importlib
import os

# Imported by name: this module is loaded only by ``_triton_plan.kernels`` when a
# Triton step runs, so ``import bigbatch.optim`` still needs only torch.
triton = importlib.import_module("triton")
tl = importlib.import_module("triton.language")


# The loader sets this while it runs this file: interpreted or compiled.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _device_function(fn):
    """A helper the kernels call: jit-compiled with them, but plain Python under the
    interpreter, which re-patches ``triton.language`` on every call of a jit
    function (~2 ms each: most of the interpreted tests' time)."""
    return fn if _INTERPRET else triton.jit(fn)


def _add(a, b):
    return a + b


# The kernels use triton.language's builtins only, never its own jit functions
# (tl.zeros, tl.sum): those took one mode when Triton was first imported, and a
# process may run both (interpreted CPU tests, compiled CUDA tests). The sum is a
# reduction with our own combine function; the interpreter recognises its own
# ``_sum_combine`` and sums with numpy.
_SUM = tl.standard._sum_combine if _INTERPRET else triton.jit(_add)


@_device_function
def _f64(x):
    return tl.full((), x, tl.float64)


@_device_function
def _store(ptr, x, mask, out_dtype: tl.constexpr):
    """Store ``x`` as ``out_dtype``; bfloat16 rounded to nearest-even by hand, so the
    interpreter (which truncates) and compiled code give the same bits."""
    if out_dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        tl.store(ptr, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, x.to(out_dtype), mask=mask)


@_device_function
def _sqrt(x, compute: tl.constexpr):
    """Correctly rounded square root (as torch's), in float32 or float64."""
    return tl.sqrt_rn(x) if compute == tl.float32 else tl.sqrt(x)


@_device_function
def _row(ptrs, role, n_tensors, t, DTYPE: tl.constexpr):
    """The address in row ``role`` of tensor ``t``, as a pointer to ``DTYPE``."""
    return tl.load(ptrs + role * n_tensors + t).to(tl.pointer_type(DTYPE))


@_device_function
def _stream(ptrs, role, n_tensors, t, start, DTYPE: tl.constexpr, ALIGN: tl.constexpr):
    """Where chunk ``start`` of tensor ``t`` begins in row ``role``; with ALIGN > 1 the
    host checked that every address is 16-byte aligned, and says so to the compiler
    (it then moves 16 bytes per load and store instead of one element)."""
    # Loaded here, not through _row: a hint on a value another function returned is
    # lost when that function is inlined.
    p = tl.load(ptrs + role * n_tensors + t).to(tl.pointer_type(DTYPE))
    if ALIGN > 1:
        p = tl.multiple_of(p, 16)
    return p + start


@_device_function
def _chunk(chunk_tensor, chunk_start, numel, c, CHUNK: tl.constexpr, ALIGN: tl.constexpr):
    """(tensor, first element, length) of chunk ``c``; with ALIGN > 1 the host checked
    that every tensor's size is a multiple of ALIGN elements (so every chunk's is)."""
    t = tl.load(chunk_tensor + c)
    start = tl.load(chunk_start + c)
    n = tl.minimum(tl.load(numel + t) - start, CHUNK)
    if ALIGN > 1:
        start = tl.multiple_of(start, ALIGN)
        n = tl.multiple_of(n, ALIGN)
    return t, start, n


@_device_function
def _bias_corrections(step, log_beta1, log_beta2, BIAS: tl.constexpr):
    """``(1 - beta1^step, 1 - beta2^step)`` in float64; (1, 1) without bias correction."""
    if BIAS:
        bc1 = 1.0 - tl.exp(step * _f64(log_beta1))
        bc2 = 1.0 - tl.exp(step * _f64(log_beta2))
    else:
        bc1 = _f64(1.0)
        bc2 = _f64(1.0)
    return bc1, bc2


@_device_function
def _kept(found, SKIP: tl.constexpr):
    """Whether this step changes anything: with SKIP, only where the overflow flag
    ``found`` (GradScaler's, a float32 0-d tensor) is 0."""
    if SKIP:
        return tl.load(found) == 0.0
    return True


@_device_function
def _rate(lr_ptr, lr_value, LR_PTR: tl.constexpr):
    """The learning rate: a 0-d device tensor's value, or the float argument."""
    return tl.load(lr_ptr).to(tl.float64) if LR_PTR else _f64(lr_value)


@_device_function
def _sum_chunks(partials, first_chunk, t, K: tl.constexpr, RBLOCK: tl.constexpr):
    """Tensor ``t``'s chunk partials ``partials[K*c + k]`` summed for k = 0 (and 1 when
    K = 2), always in the same order: every program, and ``reduce_chunks``, gets the
    same bits."""
    c1 = tl.load(first_chunk + t + 1)
    acc0 = tl.full((RBLOCK,), 0.0, tl.float64)
    acc1 = tl.full((RBLOCK,), 0.0, tl.float64)
    i = tl.load(first_chunk + t)
    while i < c1:
        offs = i + tl.arange(0, RBLOCK)
        mask = offs < c1
        acc0 += tl.load(partials + K * offs, mask=mask, other=0.0)
        if K == 2:
            acc1 += tl.load(partials + K * offs + 1, mask=mask, other=0.0)
        i += RBLOCK
    return tl.reduce(acc0, 0, _SUM), tl.reduce(acc1, 0, _SUM)


@_device_function
def _tensor_squares(partials, first_chunk, squares, t, SUMMED: tl.constexpr,
                    RBLOCK: tl.constexpr):
    """Tensor ``t``'s two sums of squares: read from ``squares`` (SUMMED), or added
    from its chunks' ``partials``."""
    if SUMMED:
        a = tl.load(squares + 2 * t)
        b = tl.load(squares + 2 * t + 1)
    else:
        a, b = _sum_chunks(partials, first_chunk, t, 2, RBLOCK)
    return a, b


@triton.jit(do_not_specialize=["n_tensors", "chunk0", "role"])
def sum_squares(ptrs, n_tensors, chunk_tensor, chunk_start, numel, out, chunk0, role,
                W: tl.constexpr, C: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                ALIGN: tl.constexpr):
    """``out[c]``: the sum of squares of chunk ``c`` of the tensors in row ``role``."""
    c = chunk0 + tl.program_id(0)
    t, start, n = _chunk(chunk_tensor, chunk_start, numel, c, CHUNK, ALIGN)
    x_ptr = _stream(ptrs, role, n_tensors, t, start, W, ALIGN)
    acc = tl.full((BLOCK,), 0.0, C)
    i = 0
    while i < n:
        offs = tl.multiple_of(i, BLOCK) + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(C)
        acc += x * x
        i += BLOCK
    tl.store(out + c, tl.reduce(acc, 0, _SUM).to(tl.float64))


@triton.jit
def reduce_chunks(partials, first_chunk, squares, K: tl.constexpr, RBLOCK: tl.constexpr):
    """Per tensor ``t`` (a program each): ``squares[K*t + k]`` = the sum of its chunks'
    ``partials[K*c + k]`` (``_sum_chunks``)."""
    t = tl.program_id(0)
    a, b = _sum_chunks(partials, first_chunk, t, K, RBLOCK)
    tl.store(squares + K * t, a)
    if K == 2:
        tl.store(squares + K * t + 1, b)


@triton.jit(do_not_specialize=["n_tensors", "chunk0"])
def lamb_moments(ptrs, n_tensors, chunk_tensor, chunk_start, numel, partials, scalars, chunk0,
                 total, beta1: tl.float64, beta2: tl.float64, log_beta1: tl.float64,
                 log_beta2: tl.float64, eps: tl.float64, weight_decay: tl.float64,
                 max_norm: tl.float64, found, W: tl.constexpr, S: tl.constexpr,
                 C: tl.constexpr, BIAS: tl.constexpr, NORMS: tl.constexpr, CLIP: tl.constexpr,
                 SKIP: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 ALIGN: tl.constexpr):
    """LAMB's first pass over one chunk (rows: w, g, step, m, v)::

        g = g / clip                       (CLIP: clip = max(||g_all|| / max_norm, 1), stored)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g^2
        u = (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * w     (bc: at step + 1)

    ``u`` is not stored: the second pass recomputes it from the stored moments
    (reading m, v, w there moves as many bytes as writing u here and reading it
    back, and needs no buffer). With NORMS, the chunk's sums of ``w^2`` and
    ``u^2`` go to ``partials[2c]``, ``partials[2c + 1]``. The first chunk puts
    the new step count in ``scalars[t]``. With SKIP and the overflow flag set, nothing
    is written but the unchanged count (both passes then walk no elements).
    """
    c = chunk0 + tl.program_id(0)
    t, start, n = _chunk(chunk_tensor, chunk_start, numel, c, CHUNK, ALIGN)
    kept = _kept(found, SKIP)
    n = tl.where(kept, n, 0)
    w_ptr = _stream(ptrs, 0, n_tensors, t, start, W, ALIGN)
    g_ptr = _stream(ptrs, 1, n_tensors, t, start, W, ALIGN)
    m_ptr = _stream(ptrs, 3, n_tensors, t, start, S, ALIGN)
    v_ptr = _stream(ptrs, 4, n_tensors, t, start, S, ALIGN)
    step = tl.load(_row(ptrs, 2, n_tensors, t, tl.float32)).to(tl.float64) \
        + tl.where(kept, 1.0, 0.0)
    tl.store(scalars + t, step, mask=start == 0)
    bc1, bc2 = _bias_corrections(step, log_beta1, log_beta2, BIAS)
    if CLIP:
        norm = tl.sqrt(tl.load(total))
        clip = tl.where(norm > _f64(max_norm), norm / _f64(max_norm), 1.0).to(C)
    b1 = _f64(beta1).to(C)
    b2 = _f64(beta2).to(C)
    a1 = (1.0 - _f64(beta1)).to(C)
    a2 = (1.0 - _f64(beta2)).to(C)
    c1 = bc1.to(C)
    c2 = bc2.to(C)
    e = _f64(eps).to(C)
    wd = _f64(weight_decay).to(C)
    acc_w = tl.full((BLOCK,), 0.0, C)
    acc_u = tl.full((BLOCK,), 0.0, C)
    i = 0
    while i < n:
        offs = tl.multiple_of(i, BLOCK) + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(C)
        if CLIP:
            g = g / clip
            _store(g_ptr + offs, g, mask, W)
        m = b1 * tl.load(m_ptr + offs, mask=mask, other=0.0).to(C) + a1 * g
        v = b2 * tl.load(v_ptr + offs, mask=mask, other=0.0).to(C) + a2 * g * g
        _store(m_ptr + offs, m, mask, S)
        _store(v_ptr + offs, v, mask, S)
        if NORMS:
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(C)
            u = (m / c1) / (_sqrt(v / c2, C) + e) + wd * w
            u = tl.where(mask, u, 0.0)  # eps = 0 makes 0 / 0 on masked lanes
            acc_w += w * w
            acc_u += u * u
        i += BLOCK
    if NORMS:
        tl.store(partials + 2 * c, tl.reduce(acc_w, 0, _SUM).to(tl.float64))
        tl.store(partials + 2 * c + 1, tl.reduce(acc_u, 0, _SUM).to(tl.float64))


@_device_function
def _lamb_ratio(w_square, u_square, TRUST_CLIP: tl.constexpr):
    """``||w|| / ||u||`` from the squared norms, 1 where either is 0; capped at 1
    with TRUST_CLIP (``_steps.lamb_trust_ratio``)."""
    w_norm = tl.sqrt(w_square)
    u_norm = tl.sqrt(u_square)
    skip = (w_norm == 0.0) | (u_norm == 0.0)
    ratio = w_norm / tl.where(skip, 1.0, u_norm)
    if TRUST_CLIP:
        ratio = tl.minimum(ratio, 1.0)
    return tl.where(skip, 1.0, ratio)


@triton.jit(do_not_specialize=["n_tensors", "chunk0"])
def lamb_update(ptrs, n_tensors, chunk_tensor, chunk_start, numel, first_chunk, partials,
                squares, scalars, chunk0, lr_ptr, lr_value: tl.float64,
                log_beta1: tl.float64, log_beta2: tl.float64, eps: tl.float64,
                weight_decay: tl.float64, ratios, positions, found, W: tl.constexpr,
                S: tl.constexpr, C: tl.constexpr, BIAS: tl.constexpr, ADAPT: tl.constexpr,
                TRUST_CLIP: tl.constexpr, SUMMED: tl.constexpr, LR_PTR: tl.constexpr,
                SKIP: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                ALIGN: tl.constexpr, RBLOCK: tl.constexpr):
    """LAMB's second pass: ``w -= lr * ratio * u``, ``u`` recomputed from the stored
    moments exactly as the first pass computed it. The tensor's first chunk stores
    the step count, and the ratio at ``ratios[positions[t]]``."""
    c = chunk0 + tl.program_id(0)
    t, start, n = _chunk(chunk_tensor, chunk_start, numel, c, CHUNK, ALIGN)
    n = tl.where(_kept(found, SKIP), n, 0)
    w_ptr = _stream(ptrs, 0, n_tensors, t, start, W, ALIGN)
    m_ptr = _stream(ptrs, 3, n_tensors, t, start, S, ALIGN)
    v_ptr = _stream(ptrs, 4, n_tensors, t, start, S, ALIGN)
    step = tl.load(scalars + t)
    first = start == 0
    tl.store(_row(ptrs, 2, n_tensors, t, tl.float32), step.to(tl.float32), mask=first)
    bc1, bc2 = _bias_corrections(step, log_beta1, log_beta2, BIAS)
    if ADAPT:
        w_square, u_square = _tensor_squares(partials, first_chunk, squares, t, SUMMED, RBLOCK)
        ratio = _lamb_ratio(w_square, u_square, TRUST_CLIP)
    else:
        ratio = _f64(1.0)
    tl.store(ratios + tl.load(positions + t), ratio, mask=first)
    scale = (-_rate(lr_ptr, lr_value, LR_PTR) * ratio).to(C)
    c1 = bc1.to(C)
    c2 = bc2.to(C)
    e = _f64(eps).to(C)
    wd = _f64(weight_decay).to(C)
    i = 0
    while i < n:
        offs = tl.multiple_of(i, BLOCK) + tl.arange(0, BLOCK)
        mask = offs < n
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(C)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(C)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(C)
        u = (m / c1) / (_sqrt(v / c2, C) + e) + wd * w
        _store(w_ptr + offs, w + scale * u, mask, W)
        i += BLOCK


@triton.jit(do_not_specialize=["n_tensors", "chunk0"])
def lars_norms(ptrs, n_tensors, chunk_tensor, chunk_start, numel, partials, scalars, chunk0,
               W: tl.constexpr, S: tl.constexpr, C: tl.constexpr, NORMS: tl.constexpr,
               CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """LARS's first pass (rows: w, g, b, local_lr): with NORMS the chunk's sums of
    ``w^2`` and ``g^2`` into ``partials``; the first chunk copies the stored
    ``local_lr`` to ``scalars[t]``."""
    c = chunk0 + tl.program_id(0)
    t, start, n = _chunk(chunk_tensor, chunk_start, numel, c, CHUNK, ALIGN)
    prev = tl.load(_row(ptrs, 3, n_tensors, t, S)).to(tl.float64)
    tl.store(scalars + t, prev, mask=start == 0)
    if NORMS:
        w_ptr = _stream(ptrs, 0, n_tensors, t, start, W, ALIGN)
        g_ptr = _stream(ptrs, 1, n_tensors, t, start, W, ALIGN)
        acc_w = tl.full((BLOCK,), 0.0, C)
        acc_g = tl.full((BLOCK,), 0.0, C)
        i = 0
        while i < n:
            offs = tl.multiple_of(i, BLOCK) + tl.arange(0, BLOCK)
            mask = offs < n
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(C)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(C)
            acc_w += w * w
            acc_g += g * g
            i += BLOCK
        tl.store(partials + 2 * c, tl.reduce(acc_w, 0, _SUM).to(tl.float64))
        tl.store(partials + 2 * c + 1, tl.reduce(acc_g, 0, _SUM).to(tl.float64))


@_device_function
def _lars_local_lr(w_square, g_square, lr, coeff, weight_decay, eps, TRUST_CLIP: tl.constexpr):
    """``_steps.lars_local_lr`` in float64: ``lr * coeff * ||w|| / (||g|| + wd ||w|| + eps)``
    (TRUST_CLIP: the adaptive rate capped at lr); lr where either norm is 0."""
    w_norm = tl.sqrt(w_square)
    g_norm = tl.sqrt(g_square)
    skip = (w_norm == 0.0) | (g_norm == 0.0)
    adaptive = coeff * w_norm / tl.where(skip, 1.0, g_norm + weight_decay * w_norm + eps)
    local = tl.minimum(adaptive, lr) if TRUST_CLIP else lr * adaptive
    return tl.where(skip, lr, local)


@triton.jit(do_not_specialize=["n_tensors", "chunk0"])
def lars_update(ptrs, n_tensors, chunk_tensor, chunk_start, numel, first_chunk, partials,
                squares, scalars, chunk0, lr_ptr, lr_value: tl.float64, momentum: tl.float64,
                weight_decay: tl.float64, coeff: tl.float64, eps: tl.float64, ratios,
                positions, found, W: tl.constexpr, S: tl.constexpr, C: tl.constexpr,
                ADAPT: tl.constexpr, TRUST_CLIP: tl.constexpr, NESTEROV: tl.constexpr,
                SUMMED: tl.constexpr, LR_PTR: tl.constexpr, SKIP: tl.constexpr,
                CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                RBLOCK: tl.constexpr):
    """LARS's second pass, ``_steps.lars_momentum_coefficients`` then the momentum
    step, in the buffer's units (see ``lars.py``)::

        d = g + weight_decay * w           (0 where local_lr is 0, even for an infinite g)
        b = carry * b + d
        w = w - unit * b                   (Nesterov: w - momentum * unit * b - local_lr * d)

    The tensor's first chunk stores ``unit`` as its new ``local_lr`` (every chunk
    read the previous one from ``scalars``), and ``local_lr / lr`` in ``ratios``. With
    SKIP and the overflow flag set, it writes back the previous ``local_lr`` only.
    """
    c = chunk0 + tl.program_id(0)
    t, start, n = _chunk(chunk_tensor, chunk_start, numel, c, CHUNK, ALIGN)
    kept = _kept(found, SKIP)
    n = tl.where(kept, n, 0)
    lr = _rate(lr_ptr, lr_value, LR_PTR)
    mu = _f64(momentum)
    wd64 = _f64(weight_decay)
    if ADAPT:
        w_square, g_square = _tensor_squares(partials, first_chunk, squares, t, SUMMED, RBLOCK)
        local_lr = _lars_local_lr(w_square, g_square, lr, _f64(coeff), wd64, _f64(eps),
                                  TRUST_CLIP)
    else:
        local_lr = lr
    prev = tl.load(scalars + t)
    zero = local_lr == 0.0
    unit = tl.where(zero, tl.where(prev == 0.0, 1.0, prev), local_lr)
    first = start == 0
    _store(_row(ptrs, 3, n_tensors, t, S), tl.where(kept, unit, prev), first, S)
    if ADAPT:
        ratio = tl.where(lr == 0.0, 1.0, local_lr / tl.where(lr == 0.0, 1.0, lr))
    else:
        ratio = _f64(1.0)
    tl.store(ratios + tl.load(positions + t), ratio, mask=first)
    carry = (mu * prev / unit).to(C)
    w_coef = (mu * unit).to(C) if NESTEROV else unit.to(C)
    d_rate = local_lr.to(C)
    wd = wd64.to(C)
    w_ptr = _stream(ptrs, 0, n_tensors, t, start, W, ALIGN)
    g_ptr = _stream(ptrs, 1, n_tensors, t, start, W, ALIGN)
    b_ptr = _stream(ptrs, 2, n_tensors, t, start, S, ALIGN)
    i = 0
    while i < n:
        offs = tl.multiple_of(i, BLOCK) + tl.arange(0, BLOCK)
        mask = offs < n
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(C)
        d = tl.load(g_ptr + offs, mask=mask, other=0.0).to(C) + wd * w
        # Selected, not multiplied: an infinite gradient (local_lr 0) adds nothing (0 * inf).
        d = tl.where(zero, 0.0, d)
        b = carry * tl.load(b_ptr + offs, mask=mask, other=0.0).to(C) + d
        _store(b_ptr + offs, b, mask, S)
        w = w - w_coef * b
        if NESTEROV:
            w = w - d_rate * d
        _store(w_ptr + offs, w, mask, W)
        i += BLOCK


def dtype(torch_dtype) -> tl.dtype:
    """Triton's name for a torch floating-point dtype."""
    return {"torch.float32": tl.float32, "torch.float64": tl.float64,
            "torch.bfloat16": tl.bfloat16, "torch.float16": tl.float16}[str(torch_dtype)]
