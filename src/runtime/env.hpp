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

inline constexpr Knob kBackwardPath{"MOK_BACKWARD_PATH", "fused",
                                    "fused: the persistent backward megakernel (the unfused launches where a shape is "
                                    "past its limits: docs/design.md); unfused: the same tiles as separate launches "
                                    "(the bitwise reference of the fused kernel in tests)"};

inline constexpr Knob kBackwardMinibatch{"MOK_BACKWARD_MINIBATCH", "0",
                                         "fused backward: rows per minibatch of its task list (a divisor of the "
                                         "macrobatch; 0: its rule, docs/design.md)"};

inline constexpr Knob kForwardStartGather{"MOK_FORWARD_START_GATHER", "1",
                                          "fused forward: minibatches of row blocks that every block of the kernel "
                                          "gathers at its start, before the comm blocks take the rest (0: the comm "
                                          "blocks gather every block)"};

inline constexpr Knob kBackwardStartGather{"MOK_BACKWARD_START_GATHER", "1",
                                           "fused backward: minibatches of row blocks that every block of the kernel "
                                           "gathers at its start, before the comm blocks take the rest (0: the comm "
                                           "blocks gather every block)"};

inline constexpr Knob kGemmTimeout{"MOK_GEMM_TIMEOUT_S", "60",
                                   "grouped-GEMM launches (mokGroupedGemm, mokGroupedWgrad): seconds every wait "
                                   "of the kernel may take before it gives up (tests set it low)"};

inline std::string get(const Knob& k) {
  const char* v = std::getenv(k.name);
  return (v && *v) ? std::string(v) : std::string(k.fallback);
}
inline long get_int(const Knob& k) { return std::strtol(get(k).c_str(), nullptr, 10); }

}  // namespace mok::env
