#pragma once

// Umbrella header: the ops, the passes and the optimize pipeline.

#include "torchfuse/ops.h"
#include "torchfuse/optimize.h"
#include "torchfuse/passes.h"
