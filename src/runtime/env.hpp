// Runtime knobs read from the environment, declared in one place with their help text.
#pragma once

#include <cstdlib>
#include <string>

namespace mok::env {

struct Knob {
  const char* name;
  const char* fallback;
  const char* help;
};

inline constexpr Knob kForwardPath{"MOK_FORWARD_PATH", "fused",
                                   "fused: the persistent megakernel; unfused: the same tiles as separate "
                                   "launches (the bitwise reference of the fused kernel in tests)"};
inline constexpr Knob kTileNGroup{"MOK_TILE_N_GROUP", "8",
                                  "N-blocks per raster group: tiles are walked m-major within groups of this "
                                  "many N-blocks, so the weights of a group stay in L2 while row blocks pass"};

inline constexpr Knob kTrace{"MOK_TRACE", "0",
                              "1: workspaces created from now on record the fused kernels' timing ring "
                              "(mokWorkspaceReadTrace; tools/trace_forward.py draws it)"};

inline constexpr Knob kGather{"MOK_GATHER", "warps",
                               "fused kernels' gather: warps (one row in flight per comm warp), pipeline "
                               "(one thread per comm block keeps ~8 row loads and 4 stores in flight) or pairs "
                               "(the backward: a row's x and dy in flight together per comm warp, H <= 4096; "
                               "the forward gathers as warps)"};

inline constexpr Knob kPush{"MOK_PUSH", "epilogue",
                             "fused forward output rows: epilogue (the down GEMM's epilogue stores each row "
                             "to its home slot, over NVLink at EP >= 2) or comm (the epilogue stores into the "
                             "ring and the comm blocks push rows home with bulk copies)"};

inline constexpr Knob kWgradCluster{"MOK_WGRAD_CLUSTER", "1",
                                    "grouped wgrad launches (mokGroupedWgrad, the unfused backward): 1 = one CTA "
                                    "per tile; 2 = 2-CTA clusters, the two tiles of a pair sharing their B boxes "
                                    "through TMA multicast (same bits; 0-2 % slower than one CTA per tile as measured, "
                                    "docs/perf.md session 14)"};
inline constexpr Knob kWgradEpilogue{"MOK_WGRAD_EPILOGUE", "fast",
                                     "grouped wgrad launches (mokGroupedWgrad, the unfused backward): fast (a tile "
                                     "without fp32 in or out stores bf16 alone) or generic (every tile through the "
                                     "loop that also reads and writes fp32; the same bits, for the A/B of "
                                     "docs/perf.md session 14; the fused backward always runs the generic loop)"};
inline constexpr Knob kGemmCluster{"MOK_GEMM_CLUSTER", "1",
                                   "grouped-GEMM launches (mokGroupedGemm, the unfused path): 1 = one CTA per "
                                   "tile; 2 = 2-CTA clusters, the two tiles of a pair sharing their weight "
                                   "tiles through TMA multicast (same bits)"};

inline constexpr Knob kGemmSkew{"MOK_GEMM_SKEW", "0",
                                "grouped-GEMM launches: k-blocks by which the second consumer warpgroup starts "
                                "behind the first, so that one's epilogue runs under the other's MMAs (0: none)"};

inline constexpr Knob kBackwardPath{"MOK_BACKWARD_PATH", "fused",
                                    "fused: the persistent backward megakernel (the unfused launches where a shape is "
                                    "past its limits: docs/design.md); unfused: the same tiles as separate launches "
                                    "(the bitwise reference of the fused kernel in tests)"};

inline constexpr Knob kBackwardMinibatch{"MOK_BACKWARD_MINIBATCH", "0",
                                         "fused backward: rows per minibatch of its task list (a divisor of the "
                                         "macrobatch; 0: its rule, docs/design.md)"};

inline constexpr Knob kBackwardCombine{"MOK_BACKWARD_COMBINE", "end",
                                       "fused backward at EP = 1: end (every block reduces d topk_weights and dx "
                                       "after a grid barrier) or overlap (two warps of every block's producer "
                                       "warpgroup reduce them as their inputs complete, under the last tiles; the "
                                       "same bits; not yet measured)"};

inline constexpr Knob kBackwardPregather{"MOK_BACKWARD_PREGATHER", "0",
                                         "fused backward: rows of the first row blocks gathered by a launch on every "
                                         "SM before the kernel (a multiple of 128; 0: the comm blocks gather all)"};

inline constexpr Knob kConsumerSync{"MOK_CONSUMER_SYNC", "warpgroup",
                                    "fused kernels' two consumer warpgroups: warpgroup (each takes the next task "
                                    "and hands its finished half on by itself, so that one's epilogue runs under "
                                    "the other's MMAs) or tile (both meet at every task and at every tile's end)"};

inline constexpr Knob kForwardStartGather{"MOK_FORWARD_START_GATHER", "1",
                                          "fused forward: minibatches of row blocks that every block of the kernel "
                                          "gathers at its start, before the comm blocks take the rest (0: the comm "
                                          "blocks gather every block; MOK_GATHER=warps and MOK_PUSH=epilogue only)"};

inline constexpr Knob kBackwardStartGather{"MOK_BACKWARD_START_GATHER", "1",
                                           "fused backward: minibatches of row blocks that every block of the kernel "
                                           "gathers at its start, before the comm blocks take the rest (0: the comm "
                                           "blocks gather every block)"};

inline constexpr Knob kTensormapPrefetch{"MOK_TENSORMAP_PREFETCH", "none",
                                         "fused kernels' producer: none, or start (prefetch.tensormap of every "
                                         "tensor map of the kernel before the first task, as the standalone launches "
                                         "do for theirs; noise-level in the backward, docs/perf.md session 13)"};

inline constexpr Knob kGemmTileN{"MOK_GEMM_TILE_N", "256",
                                 "grouped-GEMM launches of the forward and dgrad kinds: output tile N, 256 or 128"};

inline constexpr Knob kGemmTimeout{"MOK_GEMM_TIMEOUT_S", "60",
                                   "grouped-GEMM launches (mokGroupedGemm, mokGroupedWgrad): seconds every wait "
                                   "of the kernel may take before it gives up (tests set it low)"};

inline std::string get(const Knob& k) {
  const char* v = std::getenv(k.name);
  return (v && *v) ? std::string(v) : std::string(k.fallback);
}
inline long get_int(const Knob& k) { return std::strtol(get(k).c_str(), nullptr, 10); }

}  // namespace mok::env
