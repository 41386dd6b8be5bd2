/* mlxserve: plain cblas_*gemm names forwarding to scipy-openblas32's prefixed ones.
 *
 * libmlx (the mlx[cpu] wheel) calls cblas_sgemm, which its reference BLAS serves
 * slowly. mlx_backend/cpu/blas.py loads libscipy_openblas.so and then this shim,
 * both with RTLD_GLOBAL, before mlx.core is imported, so libmlx binds to these.
 * The scipy_cblas_* symbols are left undefined here and resolve against the
 * already-loaded OpenBLAS: the shim builds without OpenBLAS present.
 *
 * A product with one row or one column (a decode step of one sequence: every linear layer
 * is a vector times a weight matrix) goes to sgemv: OpenBLAS's sgemm with m == 1 reads
 * the weights at ~10 GB/s on this machine, its sgemv at 23-58 GB/s (bench/blas_gemv.py).
 */
typedef int blasint;    /* scipy-openblas32: 32-bit ints, the cblas ABI */
typedef int cblas_enum; /* C enums are int-sized on every Linux ABI */

void scipy_cblas_sgemm(cblas_enum, cblas_enum, cblas_enum, blasint, blasint, blasint, float,
                       const float *, blasint, const float *, blasint, float, float *, blasint);
void scipy_cblas_sgemv(cblas_enum, cblas_enum, blasint, blasint, float, const float *, blasint,
                       const float *, blasint, float, float *, blasint);
void scipy_cblas_dgemm(cblas_enum, cblas_enum, cblas_enum, blasint, blasint, blasint, double,
                       const double *, blasint, const double *, blasint, double, double *,
                       blasint);
void scipy_cblas_cgemm(cblas_enum, cblas_enum, cblas_enum, blasint, blasint, blasint,
                       const void *, const void *, blasint, const void *, blasint, const void *,
                       void *, blasint);

enum { ROW_MAJOR = 101, COL_MAJOR = 102, NO_TRANS = 111, TRANS = 112 };

static long mlxserve_sgemm_calls;

long mlxserve_shim_sgemm_calls(void) {
    return __atomic_load_n(&mlxserve_sgemm_calls, __ATOMIC_RELAXED);
}

void cblas_sgemm(cblas_enum order, cblas_enum ta, cblas_enum tb, blasint m, blasint n,
                 blasint k, float alpha, const float *a, blasint lda, const float *b,
                 blasint ldb, float beta, float *c, blasint ldc) {
    __atomic_fetch_add(&mlxserve_sgemm_calls, 1, __ATOMIC_RELAXED);
    if (order == COL_MAJOR) {
        /* Column-major C = op(A) op(B) is row-major C^T = op(B)^T op(A)^T. */
        order = ROW_MAJOR;
        cblas_enum t = ta;
        ta = tb;
        tb = t;
        blasint mn = m;
        m = n;
        n = mn;
        const float *ab = a;
        a = b;
        b = ab;
        blasint ld = lda;
        lda = ldb;
        ldb = ld;
    }
    if (order != ROW_MAJOR || k <= 0 || (m != 1 && n != 1)) {
        scipy_cblas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    /* BLAS leaves C unread when beta == 0, but OpenBLAS's gemv scales y by beta, and MLX's
     * output buffers are uninitialized (0 * NaN is NaN): clear them first. */
    blasint len = m == 1 ? n : m, incy = m == 1 ? 1 : ldc;
    if (beta == 0.0f)
        for (blasint i = 0; i < len; i++)
            c[(long)i * incy] = 0.0f;
    if (m == 1) {
        /* C[0, j] = sum_i x[i] op(B)[i, j], x = op(A)'s one row. */
        blasint incx = ta == NO_TRANS ? 1 : lda;
        if (tb == NO_TRANS)
            scipy_cblas_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, incx, beta, c, 1);
        else
            scipy_cblas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, incx, beta, c, 1);
    } else {
        /* C[i, 0] = sum_j op(A)[i, j] x[j], x = op(B)'s one column. */
        blasint incx = tb == NO_TRANS ? ldb : 1;
        if (ta == NO_TRANS)
            scipy_cblas_sgemv(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, b, incx, beta, c, ldc);
        else
            scipy_cblas_sgemv(ROW_MAJOR, TRANS, k, m, alpha, a, lda, b, incx, beta, c, ldc);
    }
}

void cblas_dgemm(cblas_enum order, cblas_enum ta, cblas_enum tb, blasint m, blasint n,
                 blasint k, double alpha, const double *a, blasint lda, const double *b,
                 blasint ldb, double beta, double *c, blasint ldc) {
    scipy_cblas_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(cblas_enum order, cblas_enum ta, cblas_enum tb, blasint m, blasint n,
                 blasint k, const void *alpha, const void *a, blasint lda, const void *b,
                 blasint ldb, const void *beta, void *c, blasint ldc) {
    scipy_cblas_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
