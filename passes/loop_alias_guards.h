#pragma once

// Guards for loop-carried writes that AliasDb misses (docs/passes.md).
//
// NB: AliasDb (AliasDb::analyzeLoop) lets a loop body's carried input alias
// only the loop's initial input, not the value the previous iteration
// returned, so torch's passes (DCE, CSE) may drop or move a write that the
// next iteration observes.  The pipeline guards such slots before any torch
// pass runs, removes the guards after the fusions, and seals the slots in a
// form that survives serialization.

#include <torch/csrc/jit/ir/ir.h>

#include <memory>

namespace torchfuse::passes {

// Inlines calls to free functions and to methods of non-module classes with
// a copy of the callee's own (unoptimized) graph, recursively: the shared
// callee, and the optimized graph cached for it, stay untouched.
void inlineSharedFunctions(torch::jit::Block* block);

// Makes every exposed loop slot visible to AliasDb: a prim::Print of a tuple
// of its received and returned values at the end of the body.
void guardLoopCarriedAliases(const std::shared_ptr<torch::jit::Graph>& graph);

// Removes the guards, and what only they kept alive.
void removeLoopCarriedAliasGuards(const std::shared_ptr<torch::jit::Graph>& graph);

// The persistent form of a guard: an exposed slot returns
// `[returned, received][0]`.
void sealLoopCarriedAliases(const std::shared_ptr<torch::jit::Graph>& graph);

} // namespace torchfuse::passes
