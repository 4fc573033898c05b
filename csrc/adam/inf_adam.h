/*
 * inf_adam: one fused pass of Adam / AdamW over fp32 master weights on the CPU.
 *
 * For each element i, in this order, in float32 arithmetic (fma: one rounding):
 *     g  = float(grad[i]) * grad_scale              unscale and clip factor in one multiplier
 *     g  = fma(p, weight_decay, g)                  Adam (L2), only when weight_decay != 0
 *     p  = p * (1 - lr * weight_decay)              AdamW (decoupled), only when weight_decay != 0
 *     m  = fma(w, g - m, m)                         torch's lerp_(g, w), w = 1 - beta1 < 0.5;
 *        = fma(w - 1, g - m, g)                     the same lerp when w >= 0.5
 *     v  = fma((1 - beta2) * g, g, v * beta2)       torch's mul_(beta2).addcmul_(g, g, 1 - beta2)
 *     d  = sqrt(v) * (1 / sqrt(1 - beta2^step)) + eps
 *     p  = p - (lr / (1 - beta1^step) * m) / d
 *     out[i] = p rounded to bf16 or fp16 (nearest even), when out is given
 * This is the operation order of torch's CPU Adam/AdamW (single-tensor path), including where
 * its compiled kernels fuse a multiply-add. Scalar coefficients are computed in double and
 * rounded to float once, as torch does with Python floats. Every path uses the same fused and
 * unfused operations (the scalar path through C's fmaf), so the AVX-512, AVX2 and scalar paths
 * and every thread count give bit-identical results. sqrt is IEEE (correctly rounded); torch's
 * vectorized sqrt is sometimes one ulp off, so parity with torch is to float rounding, not bits.
 *
 * [Note: lowp rounding] bf16 and fp16 copies round to nearest, ties to even, keep subnormals,
 * overflow to infinity, and turn a NaN into a quiet NaN of the same sign whose payload is the
 * top bits of the input payload (as the F16C conversion does). Non-NaN values equal torch's
 * `tensor.to(torch.bfloat16)` / `.to(torch.float16)` bit for bit.
 *
 * Memory: arrays need only element alignment (4 bytes for float, 2 for bf16/fp16); loads and
 * stores are unaligned-tolerant. param, exp_avg, exp_avg_sq, grad and out must not overlap. A
 * copy of 8 MiB or more is written with non-temporal stores (fenced before the call returns):
 * it would leave the caches before anyone reads it anyway.
 *
 * Return values: 0 on success, -errno on failure: -EINVAL for a bad argument (NULL, misaligned
 * or overlapping arrays, unknown dtype, threads < 1, step < 1), -ENOTSUP for an instruction set
 * this CPU lacks. A failed call writes nothing. Nothing here prints, exits or keeps state.
 * Thread safety: every function is reentrant and may be called concurrently from any thread,
 * provided concurrent calls do not share output arrays. inf_adam_step runs on the calling thread
 * plus at most params->threads - 1 workers of params->pool (one per 64 Ki elements, so none for
 * small arrays; none without a pool), all done before it returns; how the array is split never
 * changes the result. Concurrent calls sharing a pool take turns on its workers.
 */
#ifndef INF_ADAM_H
#define INF_ADAM_H

#include <stddef.h>
#include <stdint.h>

struct inf_pool;  /* csrc/common/inf_pool.h: worker threads owned by the caller */

/* Element type of the gradient and of the low-precision copy. */
enum inf_adam_dtype {
    INF_ADAM_DTYPE_NONE = 0,  /* out only: no copy is written */
    INF_ADAM_DTYPE_F32 = 1,
    INF_ADAM_DTYPE_BF16 = 2,
    INF_ADAM_DTYPE_F16 = 3
};

/* Instruction set of the inner loop. AUTO picks the best one this CPU supports. */
enum inf_adam_isa {
    INF_ADAM_ISA_AUTO = 0,
    INF_ADAM_ISA_SCALAR = 1,
    INF_ADAM_ISA_AVX2 = 2,    /* AVX2, FMA and F16C */
    INF_ADAM_ISA_AVX512 = 3   /* AVX-512 F */
};

/* Hyperparameters and execution choices of one step; owned by the caller, read only. */
struct inf_adam_params {
    double lr;              /* >= 0 */
    double beta1;           /* in [0, 1) */
    double beta2;           /* in [0, 1) */
    double eps;             /* >= 0 */
    double weight_decay;    /* >= 0; 0 skips decay entirely */
    double grad_scale;      /* multiplier on the gradient: 1 / loss_scale * clip factor */
    int64_t step;           /* this step's number, counting from 1 */
    int adamw;              /* nonzero: decoupled decay (AdamW); zero: L2 decay (Adam) */
    int isa;                /* enum inf_adam_isa */
    int threads;            /* >= 1; at most this many threads work on the array */
    struct inf_pool *pool;  /* workers that join the calling thread; NULL: the calling thread only */
};

/* Update n elements in place: param, exp_avg and exp_avg_sq are float arrays, grad has type
 * grad_dtype (F32, BF16 or F16), out receives the new param as out_dtype (NONE, BF16 or F16;
 * out may be NULL only with NONE). n == 0 is a no-op. */
int inf_adam_step(const struct inf_adam_params *params, float *param, const void *grad,
                  int grad_dtype, float *exp_avg, float *exp_avg_sq, void *out, int out_dtype,
                  size_t n);

/* The instruction set inf_adam_step would run for isa: returns the concrete enum inf_adam_isa
 * value (AUTO resolves to the best one available), -ENOTSUP if this CPU lacks it, -EINVAL if
 * isa is not an enum inf_adam_isa value. */
int inf_adam_isa_resolve(int isa);

/* The sum of squares of n elements of x (dtype F32, BF16 or F16), each widened to double and
 * squared exactly, summed in a fixed order ([Note: one sum on every path] in sum_squares.c):
 * the same bits on every instruction set. Finite exactly when every element is. Runs on the
 * calling thread. Returns 0, -EINVAL for a bad argument (out NULL, x NULL with n > 0, x
 * misaligned, unknown dtype or isa) or -ENOTSUP for an instruction set this CPU lacks. */
int inf_adam_sum_squares(const void *x, int dtype, size_t n, int isa, double *out);

/*
 * inf_adam_state_step: one fused pass of Adam / AdamW over one tile segment whose moments are
 * stored in fewer bytes (bf16, or 8-bit codes with a scale per block), with or without an fp32
 * master. For each element, in float32 arithmetic, each operation rounded on its own (no fused
 * multiply-add, so a reference in plain torch reproduces every bit):
 *     g  = float(grad[i]) * grad_scale
 *     p  = master[i], or float(values[i]) without a master
 *     m, v = the stored moments, decoded (8-bit: code value * block scale)
 *     g  = g + weight_decay * p                     Adam (L2), only when weight_decay != 0
 *     p  = p * (1 - lr * weight_decay)              AdamW, only when weight_decay != 0
 *     m  = beta1 * m + (1 - beta1) * g
 *     v  = beta2 * v + ((1 - beta2) * g) * g
 *     d  = sqrt(v) * (1 / sqrt(1 - beta2^step)) + eps
 *     p  = p - (lr / (1 - beta1^step) * m) / d
 * then m and v are stored (bf16: nearest even; 8-bit: each block re-coded from its new values,
 * see [Note: 8-bit moments] in adam_state_kernel.h), and p goes to master[i] (and its copy
 * values[i] rounded to nearest even, when given), or without a master to values[i] with
 * stochastic rounding (see [Note: stochastic rounding] there), whose random bits depend only
 * on (seed, step, index + i): never on the tiling, the thread split or the instruction set.
 * The AVX-512, AVX2 and scalar paths and every thread count give bit-identical results.
 *
 * Errors, memory and threads as inf_adam_step: -EINVAL for a bad argument (NULL, misaligned
 * or overlapping arrays, pieces that do not add up to n, a bad enum or block, fp32 moments with
 * a master: that is inf_adam_step's format), -ENOTSUP for an instruction set this CPU lacks; a
 * failed call writes nothing.
 */

/* Storage of the moments exp_avg and exp_avg_sq. */
enum inf_adam_moments {
    INF_ADAM_MOMENTS_F32 = 1,   /* float (with a master, use inf_adam_step) */
    INF_ADAM_MOMENTS_BF16 = 2,  /* bfloat16, rounded to nearest even */
    INF_ADAM_MOMENTS_Q8 = 3     /* one byte per element and one float scale per block */
};

/* Bounds of the 8-bit block size: a multiple of 64 elements in this range. */
enum inf_adam_block_limits {
    INF_ADAM_BLOCK_MIN = 64,
    INF_ADAM_BLOCK_MAX = 4096
};

/* One piece of a gradient; a segment's pieces lie end to end and hold n elements in all. */
struct inf_adam_grad {
    const void *data;       /* n elements of dtype (may be NULL only when n == 0) */
    size_t n;
    int dtype;              /* enum inf_adam_dtype: F32, BF16 or F16 */
};

/* The arrays of one segment, owned by the caller: element i of every array is element i of the
 * segment; 8-bit blocks start at element 0 (the last one may be short). */
struct inf_adam_segment {
    size_t n;                          /* elements */
    float *master;                     /* n floats updated in place, or NULL: no master */
    void *values;                      /* n parameters: the master's copy (may be NULL with
                                        * NONE), or, without a master, the parameters updated
                                        * in place */
    int values_dtype;                  /* NONE (master only), BF16 or F16 */
    int moments;                       /* enum inf_adam_moments */
    void *exp_avg;                     /* n moments each: float, bf16 or 8-bit codes */
    void *exp_avg_sq;
    float *exp_avg_scale;              /* 8-bit: ceil(n / block) scales each; else NULL */
    float *exp_avg_sq_scale;
    size_t block;                      /* 8-bit: elements per block; else ignored */
    const struct inf_adam_grad *grad;  /* grad_pieces pieces */
    size_t grad_pieces;
    uint64_t seed;                     /* stochastic rounding stream (no master) */
    uint64_t index;                    /* its counter of element 0; index + n - 1 must not
                                        * wrap */
};

int inf_adam_state_step(const struct inf_adam_params *params,
                        const struct inf_adam_segment *seg);

#endif /* INF_ADAM_H */
