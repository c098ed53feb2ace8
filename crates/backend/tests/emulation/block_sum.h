// kernels/reduce.cu's block-wide sum, which the real build compiles ahead
// of attention.cu and fold.cu, for the programs that include those.
#pragma once
#include "shim.h"
#include "../../kernels/reduce.cu"
