/* mlxserve: plain cblas_*gemm names forwarding to scipy-openblas32's prefixed ones.
 *
 * libmlx (the mlx[cpu] wheel) calls cblas_sgemm, which its reference BLAS serves
 * slowly. mlx_backend/cpu/blas.py loads libscipy_openblas.so and then this shim,
 * both with RTLD_GLOBAL, before mlx.core is imported, so libmlx binds to these.
 * The scipy_cblas_* symbols are left undefined here and resolve against the
 * already-loaded OpenBLAS: the shim builds without OpenBLAS present.
 */
typedef int blasint;    /* scipy-openblas32: 32-bit ints, the cblas ABI */
typedef int cblas_enum; /* C enums are int-sized on every Linux ABI */

void scipy_cblas_sgemm(cblas_enum, cblas_enum, cblas_enum, blasint, blasint, blasint, float,
                       const float *, blasint, const float *, blasint, float, float *, blasint);
void scipy_cblas_dgemm(cblas_enum, cblas_enum, cblas_enum, blasint, blasint, blasint, double,
                       const double *, blasint, const double *, blasint, double, double *,
                       blasint);
void scipy_cblas_cgemm(cblas_enum, cblas_enum, cblas_enum, blasint, blasint, blasint,
                       const void *, const void *, blasint, const void *, blasint, const void *,
                       void *, blasint);

static long mlxserve_sgemm_calls;

long mlxserve_shim_sgemm_calls(void) {
    return __atomic_load_n(&mlxserve_sgemm_calls, __ATOMIC_RELAXED);
}

void cblas_sgemm(cblas_enum order, cblas_enum ta, cblas_enum tb, blasint m, blasint n,
                 blasint k, float alpha, const float *a, blasint lda, const float *b,
                 blasint ldb, float beta, float *c, blasint ldc) {
    __atomic_fetch_add(&mlxserve_sgemm_calls, 1, __ATOMIC_RELAXED);
    scipy_cblas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
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
