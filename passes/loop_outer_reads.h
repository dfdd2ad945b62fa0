#pragma once

// Loops whose body reads values from outside, in a form TorchScript's
// interpreter runs correctly (docs/passes.md).
//
// NB: the interpreter (interpreter/can_emit_inline.h) may emit a node with
// one output that has one use, a prim::Loop included, inside its user's
// expression tree, after the loads of the user's earlier operands.  It moves
// a value out of its register at the use it emits last (code_impl.h,
// emitUse), so a read in the loop body of a value that such an operand also
// reads becomes a move, and the second iteration reads None ("Expected
// Tensor but got None").  In `for ...: x0 = x1` followed by
// `x1 - relu(conv2d(x0))`, the loop runs inside the sub's tree once relu is
// one op (a fused custom_relu; TorchScript's own relu(inplace=True) is a
// prim::If, whose input has two uses).  A scripted function of that shape
// fails the same way under torch.jit.optimized_execution(False).

#include <torch/csrc/jit/ir/ir.h>

#include <memory>

namespace torchfuse::passes {

// True when the body of `loop` (nested blocks included) reads a
// non-constant value defined outside the loop, and the loop or a node
// enclosing it has one output with one use: the interpreter may then emit
// it inside an expression tree and move that value out in the first
// iteration.
bool loopMayMoveOuterValue(torch::jit::Node* loop);

// For each loop where loopMayMoveOuterValue holds (outer loops first),
// passes every non-constant value from outside that the body reads through
// the loop as a carried value, which the body returns as `[received][0]`:
// the body reads its own block inputs only, and the loop has more than one
// output, so it is never emitted inline.  The meaning is kept, zero trips
// included (the new outputs are unused; the existing slots are untouched),
// and the carried values are the same objects.  Returns the number of loops
// rewritten.
int64_t carryOuterValuesThroughLoops(const std::shared_ptr<torch::jit::Graph>& graph);

} // namespace torchfuse::passes
