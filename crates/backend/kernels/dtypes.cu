// Storage codes shared with the host (crates/backend/src/cuda/kernels.rs,
// `dtype_code`): compiled first, ahead of common.cu, and included by the host
// emulation of the kernels (tests/emulation/shim.h), so both read one table.
#ifndef CORRIDOR_DTYPES
#define CORRIDOR_DTYPES
#define DT_F32 0
#define DT_BF16 1
#define DT_Q8_0 2
#define DT_Q4_0 3
#define DT_Q4_1 4
#define DT_Q5_0 5
#define DT_Q5_1 6
#define DT_IQ4_NL 7
#define DT_Q2_K 8
#define DT_Q3_K 9
#define DT_Q4_K 10
#define DT_Q5_K 11
#define DT_Q6_K 12
#define DT_IQ4_XS 13
#endif
