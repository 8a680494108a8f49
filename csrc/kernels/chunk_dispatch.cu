#include "dispatch.cuh"
#include "chunk.h"

namespace fla {

FLA_DECLARE_LAUNCH(launch_chunk, ChunkPass)
FLA_DECLARE_LAUNCH(launch_chunk_vdecay, ChunkPass)

const char* chunk_cuda(const ChunkPass& p, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  // A value-side decay runs as the transposed key-side problem (chunk_vdecay.cuh); the op
  // refuses g and gv together on CUDA before anything runs.
  if (p.gv.on() && p.g.on()) return "chunk engine: g and gv together are not supported on CUDA";
  // gv's pointer is null when it has no elements (T = 0): then nothing is stored and the state
  // passes through, so o_softmax asks only that no key-side decay be given.
  if (p.o_softmax && (p.g.on() || p.o_acc || !chunk_softmax_on_cuda(p.V)))
    return "chunk engine: o_softmax needs the value-side decay alone, o in the inputs' dtype and V <= 64";
  if (p.dq_softmax_w.on() &&
      (p.gv.on() || p.reader != Reader::Inclusive || p.dq_acc || !chunk_softmax_on_cuda(p.K)))
    return "chunk engine: dq_softmax_w needs GLA's key-side pass, dq in the inputs' dtype and K <= 64";
  // Every pass but the fused key-side forward writes or reads hst, unless it has no state element
  // (then the op's workspace is empty and its pointer null: an empty batch is not an error).
  const bool states = p.N > 0 && p.H > 0 && p.K > 0 && p.V > 0;
  if (!p.hst && states && (p.dout.on() || p.gv.on() || !chunk_fused_out(p.K)))
    return "chunk engine: this pass needs the hst workspace";
  return launch_for_dtype(p.dtype, [&](auto t) {
    return p.gv.on() ? launch_chunk_vdecay<decltype(t)>(p, s) : launch_chunk<decltype(t)>(p, s);
  });
}

}  // namespace fla
