/* int8 and 4-bit weight x float activation products, and the whole decode step, for
   selectinfer_ros.

   y[m, n] = scale[n] * sum_k w[n, k] * x[m, k]

   w: int8 rows of length K at row stride ldw (a prefix of wider rows is fine: the active
   columns of the down projection), scale: float32 per output row (NULL = 1), x: float32
   [M, K] contiguous, y: float32 [M, N] contiguous.

   The activations are quantized per block of 32 values to int8 with their own float scale
   (llama.cpp's Q8_0 layout), then every weight row is read once for all M activation rows.
   Where the path gains from it (si_tile_pays), the loader holds the int8 matrices of a decode
   step (output layer, attention projections, prompt-mode neuron slots) as tiles of 16
   interleaved rows instead (si_tile_pack, si_tile_linear; si_mat.tiled, si_layer.tiled).

   The instruction set is chosen at compile time from the compiler's macros (the Python side
   passes the flags for what /proc/cpuinfo lists; si_isa() names the path compiled in):
     avx512vnni  AVX-512 VNNI: vpdpbusd on two blocks (64 bytes) per instruction
     avx512bw    AVX-512BW: maddubs + madd on two blocks per instruction
     avxvnni     AVX-VNNI: vpdpbusd on 256 bits
     avx2        AVX2 + FMA (+ F16C): maddubs + madd on 256 bits
     neon-dotprod / neon-i8mm   aarch64 NEON sdot (the Jetson Orin's Cortex-A78AE)
     plain       plain C, the reference (-DSI_PLAIN forces it)
   Every path computes each block's integer dot product exactly; they differ only in the
   order of the float sums over blocks (float rounding).

   si_decode_layers (decode.c) runs every decoder layer of one decode step of an int8 model in one
   call, in one parallel region (threads meet at barriers between the products), with no
   framework dispatch between the small operations of a layer.

   The contract with the Python side (ctypes): si_abi() returns SI_ABI_VERSION and the sizes of
   the structs; the caller refuses a library whose answer differs from its own mirror. Change
   SI_ABI_VERSION with any change of a struct or of an exported function's signature.

   The source is one translation unit (static functions inline across the parts), split by
   product, each part the one reference of what it holds:
     common.h      the instruction-set path, activations quantized per block, threads
     rows_int8.c   int8 rows: one row, a few rows prepared once, the blocked prefill product
     tiles.c       int8 weights as tiles of 16 interleaved rows (output layer, projections)
     rows_q4.c     4-bit rows: the row product, the down product of 4-bit records
     rows_q4il.c   4-bit rows interleaved 16 at a time (output layer, projections)
     rows_q4g.c    4-bit neuron records held in groups of 32 slots (prompt mode's MLP)
     step.h        the decode step's structures (the ABI) and the helpers of every layer
     attention.c   one layer's attention for a batch's rows
     mlp_int8.c    the MLP over int8 neuron slots (active prefix, per-token selection)
     mlp_q4.c      the MLP over 4-bit neuron records (active prefix, per-token selection)
     mlp_tiers.c   the MLP over tiered slots: int8 and 4-bit records, each its own prefix
     decode.c      si_decode_batch: every layer of a step in one parallel region
*/
#include "common.h"
#include "rows_int8.c"
#include "tiles.c"
#include "rows_q4.c"
#include "rows_q4il.c"
#include "rows_q4g.c"
#include "step.h"
#include "attention.c"
#include "mlp_int8.c"
#include "mlp_q4.c"
#include "mlp_tiers.c"
#include "decode.c"
