/*
 * mok — deterministic MoE training megakernel for Hopper. C ABI.
 *
 * Shaped like NCCL's: opaque handles, one result enum returned by every call, a
 * last-error detail string, a versioned config struct with an initializer macro.
 * Exceptions never cross this boundary. No torch, no Python.
 *
 * Tensors are passed as non-owning views (mokTensor_t). Strides are in elements.
 * device = -1 means host memory; device >= 0 is a CUDA ordinal.
 */
#ifndef MOK_MOK_H_
#define MOK_MOK_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define MOK_API __declspec(dllexport)
#else
#define MOK_API __attribute__((visibility("default")))
#endif

/* The one version number of mok: CMake's project() version, the Python package's
 * (pyproject.toml) and mok.__version__ are all read from these lines. */
#define MOK_VERSION_MAJOR 0
#define MOK_VERSION_MINOR 6
#define MOK_VERSION_PATCH 0
#define MOK_VERSION_STRING "0.6.0"
#define MOK_VERSION_CODE (MOK_VERSION_MAJOR * 10000 + MOK_VERSION_MINOR * 100 + MOK_VERSION_PATCH)

typedef enum mokResult_t {
  mokSuccess = 0,
  mokInvalidArgument = 1,  /* bad shape/dtype/device/stride/ids: detected before any launch */
  mokInvalidUsage = 2,     /* wrong call order, config/workspace mismatch, null handle */
  mokNotSupported = 3,     /* a path that is not built (yet) or not available on this machine */
  mokCudaError = 4,        /* a CUDA runtime/driver call failed */
  mokTimeout = 5,          /* a device-side wait passed its deadline (details in last error) */
  mokDeviceInvalidRoute = 6, /* device-side validation found a bad route (details in last error) */
  mokOutOfMemory = 7,
  mokInternalError = 8,
  mokNumResults = 9
} mokResult_t;

typedef enum mokDtype_t {
  mokBFloat16 = 0,
  mokFloat32 = 1,
  mokInt32 = 2,
  mokInt64 = 3,
  mokFloat8E4M3 = 4,
  mokUInt8 = 5,
  mokNumDtypes = 6
} mokDtype_t;

typedef enum mokPrecision_t {
  mokPrecisionBF16 = 0,
  mokPrecisionMXFP8 = 1,
  mokPrecisionFP8Block = 2
} mokPrecision_t;

#define MOK_MAX_DIMS 4
#define MOK_DEVICE_CPU (-1)

/* Encodings of the plan and of the device error record (src/common/defs.hpp asserts them).
 * Row record (uint32): bits [0, 21) token, [21, 26) route index j, [26, 32) source rank;
 * MOK_PAD_ROW marks a padding row. */
#define MOK_ROW_TOKEN_BITS 21
#define MOK_ROW_SLOT_BITS 5
#define MOK_ROW_RANK_BITS 6
#define MOK_PAD_ROW 0xFFFFFFFFu
/* Route error record, 4 x int64: [0] key of the first bad route, (rank << 40) | (token << 8) | j,
 * or MOK_NO_ERROR_KEY; [1] its id; [2] its mokRouteCheck_t; [3] reserved. */
#define MOK_NO_ERROR_KEY 0x7FFFFFFFFFFFFFFFll
typedef enum mokRouteCheck_t {
  mokRouteOk = 0,
  mokRouteMasked = 1,      /* id == -1: no selection */
  mokRouteOutOfRange = 2,  /* id < -1 or id >= E */
  mokRouteDuplicate = 3    /* the same id at an earlier j of the token */
} mokRouteCheck_t;

typedef struct mokTensor_t {
  void* data;                     /* NULL with ndim == 0 means "absent" (optional tensors) */
  int32_t dtype;                  /* mokDtype_t */
  int32_t ndim;
  int64_t shape[MOK_MAX_DIMS];
  int64_t strides[MOK_MAX_DIMS];  /* in elements */
  int32_t device;                 /* MOK_DEVICE_CPU or CUDA ordinal */
  int32_t reserved;
} mokTensor_t;

/* Versioned config. Always start from MOK_CONFIG_INITIALIZER, then set fields.
 * Every field is 8 bytes wide so that the layout is the same for every binding. */
#define MOK_CONFIG_VERSION 3
typedef struct mokConfig_t {
  uint64_t size;          /* sizeof(mokConfig_t) as the caller compiled it */
  uint64_t version;       /* MOK_CONFIG_VERSION */
  /* layer dimensions (per rank) */
  int64_t hidden;               /* H */
  int64_t intermediate;         /* I of a routed expert */
  int64_t shared_intermediate;  /* I_s of the shared expert; 0 = no shared expert */
  int64_t num_experts;          /* E, total over the EP group */
  int64_t topk;                 /* k */
  int64_t ep_size;              /* P */
  int64_t ep_rank;              /* r */
  int64_t max_tokens;           /* T_max: the most tokens any rank passes in one call */
  /* knobs */
  int64_t fwd_num_comm_sms;     /* EP >= 2: blocks of the fused forward that pull rows first
                                   (EP = 1: none; the producer warpgroups gather) */
  int64_t bwd_num_comm_sms;     /* the same for the fused backward; 0 = fwd_num_comm_sms */
  int64_t minibatch_size;       /* rows; multiple of block_m; 0 = chosen by mok */
  int64_t macrobatch_size;      /* rows of the ring buffer; multiple of minibatch_size; 0 = chosen;
                                   MOK_MACROBATCH_ALL_ROWS = every row of a worst-case plan */
  int64_t block_m;              /* GEMM row block the plan pads to (128 on Hopper) */
  int64_t precision;            /* mokPrecision_t */
  double schedule_capacity_multiplier; /* accepted for MoK compatibility; sizes are worst-case */
  double timeout_s;             /* deadline of every device-side wait */
  int64_t device;               /* MOK_DEVICE_CPU or CUDA ordinal */
  int64_t num_threads;          /* CPU backend threads; 0 = hardware concurrency */
  /* since config version 2 */
  int64_t num_blocks;           /* grid of the persistent CUDA kernels; 0 = one block per SM
                                   (virtual ranks: SMs / P each, so that all P run at once) */
  /* since config version 3 */
  int64_t fp8_pow2_scales;      /* fp8_block: 1 = every scale a power of two (UE8M0, the ceiling
                                   of max |v| / 448), 0 = max |v| / 448 in fp32 */
} mokConfig_t;

/* The defaults of the knobs: their one home.  C++ (mok::default_config), the plan and the
 * Python front (mok.functional.MoKConfig, mok.ops, read through mokGetDefaultConfig) take
 * them from here. */
#define MOK_DEFAULT_FWD_NUM_COMM_SMS 8
#define MOK_DEFAULT_BWD_NUM_COMM_SMS 8
#define MOK_DEFAULT_MINIBATCH_SIZE 0   /* 0 = chosen by mok from the shape (docs/design.md) */
#define MOK_DEFAULT_MACROBATCH_SIZE 0  /* 0 = chosen by mok */
/* macrobatch_size = MOK_MACROBATCH_ALL_ROWS: the ring holds every row of a worst-case plan (one
 * macrobatch: no expert's weight-gradient sum is split into fp32 pieces), the smallest whole
 * number of minibatches that does; the training configuration docs/perf.md measured fastest,
 * at macrobatch_size * (H + I) * 2 bytes of ring. */
#define MOK_MACROBATCH_ALL_ROWS (-1)
#define MOK_DEFAULT_BLOCK_M 128
#define MOK_DEFAULT_TIMEOUT_S 60.0

#define MOK_CONFIG_INITIALIZER                                                                  \
  {                                                                                             \
    sizeof(mokConfig_t), MOK_CONFIG_VERSION, /*hidden*/ 0, /*intermediate*/ 0,                  \
        /*shared_intermediate*/ 0, /*num_experts*/ 0, /*topk*/ 0, /*ep_size*/ 1,                \
        /*ep_rank*/ 0, /*max_tokens*/ 0, MOK_DEFAULT_FWD_NUM_COMM_SMS,                          \
        MOK_DEFAULT_BWD_NUM_COMM_SMS, MOK_DEFAULT_MINIBATCH_SIZE, MOK_DEFAULT_MACROBATCH_SIZE,  \
        MOK_DEFAULT_BLOCK_M, /*precision*/ mokPrecisionBF16,                                    \
        /*schedule_capacity_multiplier*/ 1.0, MOK_DEFAULT_TIMEOUT_S,                           \
        /*device*/ MOK_DEVICE_CPU, /*num_threads*/ 0, /*num_blocks*/ 0, /*fp8_pow2_scales*/ 0  \
  }

/* Weights of one rank: its E_l = E/P routed experts and the optional shared expert.
 *   w_gate, w_up [E_l, I, H] bf16;  w_down [E_l, H, I] bf16
 *   ws_gate, ws_up [I_s, H] bf16;   ws_down [H, I_s] bf16   (absent when I_s == 0)
 * Each is read in place through its strides, as a stack of row-major matrices (stride 1 in the
 * last dimension) or of column-major ones (stride 1 in the second-to-last dimension: a
 * transposed parameter's view, e.g. w_gate = gate_up_proj[E, H, 2I].transpose(1, 2)[:, :I]),
 * whose rows (or columns) and matrices do not overlap; w_gate and w_up share their strides.
 * On CUDA also: 16-byte aligned data, a row (column) stride of a multiple of 16 bytes, an
 * expert stride that is a multiple of it; w_gate, w_up and w_down all row-major or all
 * column-major, the shared expert's row-major (column-major routed weights are read by the
 * fused kernels, not by the unfused launches: MOK_FORWARD_PATH / MOK_BACKWARD_PATH=unfused,
 * or more than 512 local experts in the backward).  The same rules hold for the gradients and
 * main_grads of mokBackwardArgs_t; on CUDA the routed ones are in the weights' orientation. */
typedef struct mokWeights_t {
  mokTensor_t w_gate, w_up, w_down;
  mokTensor_t ws_gate, ws_up, ws_down;
} mokWeights_t;

/* fp8_block (config.precision = mokPrecisionFP8Block): one weight W [.., R, C] of mokWeights_t
 * quantised per 128 x 128 block (mokQuantizeWeights writes it from W once per optimizer step):
 *   q       [.., R, C] float8_e4m3fn: W / its block's scale, in W's index order (row-major)
 *   qt      [.., C, R] float8_e4m3fn: its transpose (what the backward's dgrad GEMMs read)
 *   scales  [.., R/128, C/128] float32: one per block (a block's scale is its transpose's)
 * all contiguous, on W's device. */
typedef struct mokFp8Weight_t {
  mokTensor_t q, qt, scales;
} mokFp8Weight_t;
typedef struct mokFp8Weights_t {
  mokFp8Weight_t w_gate, w_up, w_down;
  mokFp8Weight_t ws_gate, ws_up, ws_down;
} mokFp8Weights_t;

/* One rank's forward.  x [T, H] bf16; topk_ids [T, k] int32|int64 in [-1, E);
 * topk_weights [T, k] fp32; y [T, H] bf16 (written).
 * fp8 (since 0.5): config.precision = fp8_block on CUDA reads the weights' quantised copies
 * from here (mokQuantizeWeights; q and scales, and qt for the backward), not `weights`; absent
 * (zeroed) otherwise.  The CPU reference quantises `weights` itself and ignores it. */
typedef struct mokForwardArgs_t {
  mokTensor_t x, topk_ids, topk_weights;
  mokWeights_t weights;
  mokTensor_t y;
  mokFp8Weights_t fp8;
} mokForwardArgs_t;

/* One rank's backward: the forward inputs, dy [T, H] bf16, and the gradients.
 *   dx [T, H] bf16; d_topk_weights [T, k] fp32 (0 for masked routes);
 *   grads: bf16 tensors shaped like the weights (written).  Routed-expert grads cover every
 *   row routed to this rank's experts; shared-expert grads cover this rank's own tokens
 *   only (under EP they are per-rank partial sums, to be reduced like data-parallel grads);
 *   main_grads: optional fp32 tensors shaped like the weights; when present the fp32
 *   gradient is added into them (main_grad += grad), deterministically. */
typedef struct mokBackwardArgs_t {
  mokForwardArgs_t fwd;   /* fwd.y is ignored */
  mokTensor_t dy;
  mokTensor_t dx, d_topk_weights;
  mokWeights_t grads;
  mokWeights_t main_grads;
} mokBackwardArgs_t;

/* What a training forward saves for its backward (CUDA): the gate/up pre-activations, so that
 * the backward reads them instead of recomputing them (one gate/up GEMM less).
 *   h [max_rows, 2I] bf16: [bf16(x·w_gateᵀ) | bf16(x·w_upᵀ)] of every row of the rank's plan
 *     (max_rows: mokPlanGetCapacity; rows past the plan's last block are not written);
 *   shared_h [T, 2I_s] bf16: the shared expert's, per token (absent when I_s == 0).
 * The backward that reads them must get the same inputs as the forward that wrote them. */
typedef struct mokSaved_t {
  mokTensor_t h, shared_h;
} mokSaved_t;

typedef struct mokWorkspace* mokWorkspace_t;

/* Timing ring of the fused kernels (MOK_TRACE=1 when the workspace is created): one event
 * per interval a role spent, %globaltimer nanoseconds.  Per block, recorder r in
 * [0, MOK_TRACE_RECORDERS) (0 producer, 1 tiles, 2 barrier + combine, 3 gather) owns events
 * [(block*MOK_TRACE_RECORDERS + r)*cap, +cap); unused events are all zero. */
typedef enum mokTraceRole_t {
  mokTraceGather = 0,        /* comm block: one row block gathered (begin: start, end: released) */
  mokTraceProducerWait = 1,  /* producer: task claimed -> its inputs ready */
  mokTraceProducerLoad = 2,  /* producer: inputs ready -> every TMA load of the tile issued */
  mokTraceTile = 3,          /* consumers: tile started -> its epilogue stores issued */
  mokTraceGridBarrier = 4,   /* block arrived at the grid barrier -> every block arrived */
  mokTraceCombine = 5        /* the block's share of the combine */
} mokTraceRole_t;
typedef struct mokTraceEvent_t {
  uint64_t begin_ns, end_ns;
  uint32_t role;    /* mokTraceRole_t */
  uint32_t kind;    /* task kind (0 shared gate/up, 1 gate/up, 2 shared down, 3 down), 255 none;
                       gather events: 255 a comm block's row block, 254 a block's start gather */
  int32_t block;    /* row block of the task, or of the gather */
  int32_t detail;   /* N-block of the task; -1 none */
} mokTraceEvent_t;
#define MOK_TRACE_RECORDERS 4

/* The routing plan of one rank (see docs/design.md): arrays the caller allocates with the
 * sizes mokPlanCapacity returns. */
typedef struct mokPlanCapacity_t {
  int64_t max_rows;    /* row records: P*T_max*min(k,E_l) + E_l*(block_m-1), rounded down to block_m */
  int64_t max_blocks;  /* max_rows / block_m */
  int64_t num_local_experts;
} mokPlanCapacity_t;

typedef struct mokPlanArgs_t {
  int64_t num_ranks;            /* P: one topk_ids view per source rank */
  const mokTensor_t* topk_ids;  /* [P] views, [T_s, k] int32|int64, all on the same device */
  mokTensor_t rows;             /* [max_rows] int32 (uint32 row records) */
  mokTensor_t expert_count;     /* [E_l] int32 */
  mokTensor_t expert_offset;    /* [E_l + 1] int32 */
  mokTensor_t block_expert;     /* [max_blocks] int32 */
  mokTensor_t error;            /* [4] int64: device-side error record (see docs/design.md) */
} mokPlanArgs_t;

/* Grouped GEMM over 128-row blocks (the engine of the CUDA layer, exposed for tests and
 * benchmarks).  a [M, K] bf16; block_expert [ceil(M/128)] int32, the expert of each 128-row
 * block of a, -1 for blocks past the end (their rows are left unwritten).  By kind:
 *   mokGemmDown:        out [M, N] = a · b0[e]ᵀ, b0 [E, N, K]
 *   mokGemmGateUp:      out [M, N] = silu(a · b0[e]ᵀ) ⊙ (a · b1[e]ᵀ), b0, b1 [E, N, K]
 *   mokGemmDgradDown:   out [M, N] = a · b0[e], b0 = w_down [E, K, N] as stored: da = dy · W_down
 *                       (K = H, N = I)
 *   mokGemmDgradGateUp: out [M, N] = a · [b0[e]; b1[e]], b0 = w_gate, b1 = w_up [E, K/2, N] as
 *                       stored: dx = [dg | du] · [W_gate; W_up] (K = 2I, N = H; K/2 % 64)
 *   mokGemmDgradDownSwiGLU: the dgrad of down with the SwiGLU backward in its epilogue
 *                       (docs/design.md, "The dgrad-down SwiGLU-backward epilogue").  a = dy rows
 *                       [M, H], b0 = w_down [E, H, I] as stored (K = H, N = I);
 *                       da = a · b0[e] stays in fp32 registers.  Per row r and channel i, with
 *                       g = h[r, i], u = h[r, I + i] (bf16 as stored), w = row_weight[r],
 *                       sg = sigmoid(g), sl = g·sg, a = bf16(sl·u), silu' = sg·(1 + g·(1 − sg)):
 *                         out = dh [M, 2I] bf16: dh[r, i] = bf16(w·da·u·silu'), dh[r, I + i] = bf16(w·da·sl)
 *                         wa [M, I] bf16 (optional): bf16(w·a), the wgrad-down operand
 *                         dtw_partials [M, ceil(I/128)] fp32 (optional): [r, c] = Σ da·a over channels
 *                           [128c, min(128c + 128, I)), in a fixed order; d topk_weights of the row's route
 *                           is their sum in ascending c (exact for w = 0 and w < 0: no division)
 *                       h [M, 2I] bf16 and row_weight [M] fp32 are required.  Padding rows should
 *                       have w = 0 and h = 0: they then get dh = 0, wa = 0 and partials 0.
 *   mokGemmGateUpPreact: the gate/up pre-activations without the SwiGLU (the backward's replay):
 *                       out [M, 2N] = [bf16(a · b0[e]ᵀ) | bf16(a · b1[e]ᵀ)], b0, b1 [E, N, K]
 *                       h = [g | u] as the dgrad-down SwiGLU kind reads it
 * K % 64 == 0 and N % 64 == 0 for every kind.  num_blocks: grid size, 0 = one block per SM.  CUDA tensors only.
 * The fields after num_blocks are read for mokGemmDgradDownSwiGLU only (callers compiled before
 * they existed keep working for the other kinds).
 * (kind replaced the former swiglu flag with the same values for its two kinds.) */
typedef enum mokGemmKind_t {
  mokGemmDown = 0,
  mokGemmGateUp = 1,
  mokGemmDgradDown = 2,
  mokGemmDgradGateUp = 3,
  mokGemmDgradDownSwiGLU = 4,
  mokGemmGateUpPreact = 5
} mokGemmKind_t;
typedef struct mokGroupedGemmArgs_t {
  mokTensor_t a, b0, b1, block_expert, out;
  int64_t kind;  /* mokGemmKind_t */
  int64_t num_blocks;
  /* mokGemmDgradDownSwiGLU only (see above) */
  mokTensor_t h, row_weight, wa, dtw_partials;
} mokGroupedGemmArgs_t;

/* The weight-gradient GEMM, K-grouped (the wgrad kind of the engine):
 *   out[e] [Mo, No] = Σ over rows r of expert e of a[r, :]ᵀ ⊗ b[r, :]
 *     dW_down[e]          = (w·dy)_rowsᵀ · act_rows   (a [R, H], b [R, I])
 *     [dW_gate; dW_up][e] = [dg | du]_rowsᵀ · x_rows   (a [R, 2I], b [R, H])
 * a [R, Mo], b [R, No] bf16 (Mo % 64 == 0, No % 64 == 0); expert_offset [E+1] int32, the
 * first row of each expert, a multiple of 64 (the plan's padded offsets are); expert_count [E]
 * int32, its rows, and the rows [count, round_up(count, 64)) of a and b must be zero (the
 * plan's padding rows, kept zero by the caller).  An expert with no rows gets zeros.
 * Per element, in fp32: total = (accumulate ? acc : 0) + this call's sum; then acc = total
 * (store_acc), out = bf16(total) and main_grad += total, each where the tensor is present
 * (acc, main_grad [E, Mo, No] fp32; out [E, Mo, No] bf16).  A macrobatch loop calls it once
 * per macrobatch in a fixed order (accumulate from the second call, out and main_grad on the
 * last): deterministic, no atomics.  CUDA tensors only. */
typedef struct mokGroupedWgradArgs_t {
  mokTensor_t a, b, expert_offset, expert_count;
  mokTensor_t out, acc, main_grad;
  int64_t accumulate;
  int64_t store_acc;
  int64_t num_blocks;
} mokGroupedWgradArgs_t;

MOK_API const char* mokGetErrorString(mokResult_t result);
/* Detail of the last failing call on this thread (empty when none). */
MOK_API const char* mokGetLastError(void);
MOK_API int mokGetVersion(void);
/* Writes MOK_CONFIG_INITIALIZER as this library was compiled with it: bindings that cannot
 * expand the macro (Python) read the defaults from here instead of repeating them. */
MOK_API mokResult_t mokGetDefaultConfig(mokConfig_t* config);
/* 1 when the library was compiled with its CUDA part. */
MOK_API int mokHasCuda(void);

MOK_API mokResult_t mokWorkspaceCreate(const mokConfig_t* config, mokWorkspace_t* workspace);
/* Whether this library runs the layer `config` describes on config.device: mokSuccess, or
 * mokInvalidArgument / mokNotSupported with mokGetLastError() naming why (a shape the CUDA
 * kernels do not take, no CUDA part...).  flags: MOK_SUPPORT_BACKWARD, the backward too;
 * MOK_SUPPORT_TRANSPOSED, with column-major (transposed) routed weights, which on CUDA only the
 * fused kernels read (not the separate launches that the MOK_*_PATH knobs or a backward past
 * the fused kernel's limits take).  Allocates nothing and needs no device: frameworks call it
 * to choose mok or their own path before any launch. */
#define MOK_SUPPORT_BACKWARD 1
#define MOK_SUPPORT_TRANSPOSED 2
MOK_API mokResult_t mokCheckSupport(const mokConfig_t* config, int32_t flags);

/* ---- EP >= 2: symmetric memory ---------------------------------------------------------------
 * Every rank of an EP group holds one region of mokSymmetricBytes(config) bytes with the same
 * byte map (docs/design.md); a call reads and writes its peers' regions directly (NVLink, or
 * the same device).  Providers: PyTorch symmetric memory (Python: mok.functional.get_workspace
 * with a process group), cudaMalloc + peer access over several GPUs of one process, or P
 * regions on one GPU ("virtual ranks": each rank's calls on its own stream, with
 * config.num_blocks = SMs / P).
 * regions[s] is rank s's region as this process addresses it, s in [0, ep_size);
 * regions[config->ep_rank] is this rank's own.  Before any rank's first call every region must
 * be zero-filled and every rank's workspace created (a barrier of the group orders it).
 * Calls of the group must be issued in the same order on every rank (sequence numbers). */
MOK_API mokResult_t mokSymmetricBytes(const mokConfig_t* config, size_t* bytes);
MOK_API mokResult_t mokWorkspaceCreateSymmetric(const mokConfig_t* config, void* const* regions,
                                                int64_t num_regions, mokWorkspace_t* workspace);
MOK_API mokResult_t mokWorkspaceDestroy(mokWorkspace_t workspace);
/* Writes a NUL-terminated description of the buffers and their size formulas.  *needed (if
 * not NULL) receives the bytes it takes, NUL included; buffer == NULL only asks for that. */
MOK_API mokResult_t mokWorkspaceDescribe(mokWorkspace_t workspace, char* buffer, size_t buffer_size,
                                         size_t* needed);
MOK_API mokResult_t mokWorkspaceGetConfig(mokWorkspace_t workspace, mokConfig_t* config);
/* Reports what device-side checks recorded in earlier calls (an invalid route masked by the
 * device: mokDeviceInvalidRoute; a wait past its deadline: mokTimeout), with details in the
 * last error.  wait = 0 looks only at copies that already landed (no synchronisation);
 * wait = 1 synchronises on the last call first.  Calls also check, without waiting. */
MOK_API mokResult_t mokWorkspaceCheckErrors(mokWorkspace_t workspace, int wait);

MOK_API mokResult_t mokPlanGetCapacity(const mokConfig_t* config, mokPlanCapacity_t* capacity);
/* Builds the plan of rank config->ep_rank from the gathered routing.  Host views: built on
 * the host (invalid ids are an error).  Device views: built by a CUDA kernel on `stream`
 * with no host synchronisation; invalid routes are masked and recorded in args->error. */
MOK_API mokResult_t mokPlanBuild(const mokConfig_t* config, const mokPlanArgs_t* args, void* stream);

MOK_API mokResult_t mokGroupedGemm(const mokGroupedGemmArgs_t* args, void* stream);
/* The forward kinds (mokGemmDown, mokGemmGateUp, mokGemmGateUpPreact) in fp8 with block scales
 * (DeepSeek-V3's recipe, precision fp8_block; docs/precision.md): args as for mokGroupedGemm but
 * a [M, K] and b0 / b1 [E, N, K] float8_e4m3fn, contiguous, and their fp32 scales:
 *   a_scales   [K/128, M]             row m's scale over K columns [128 kb, 128 kb + 128) at [kb, m]
 *   b0_scales  [E, ceil(N/128), K/128] the scale of each 128 x 128 block of b0[e] (rows, K)
 *   b1_scales  the same for b1 (gate/up kinds; ignored for down)
 * out = Σ over k-blocks of (the k-block's e4m3 products, summed on the tensor cores) · a scale ·
 * b scale, promoted into fp32 once per k-block (fma, k-block order), then the kind's epilogue in
 * bf16.  K % 128 == 0, N % 64 == 0, M % 4 == 0 (a_scales' rows are 16-byte aligned).  CUDA tensors.
 * Gate/up with out float8_e4m3fn [M, N] (N % 128 == 0): a = silu(g)·u in fp32 quantised for the
 * down kind, per row and 128 channels (scale = max |a| / 448, 1 for zeros; a / scale rounded to
 * nearest even, saturating), its scales written to `out` [N/128, M] fp32 (its a_scales).
 * Since 0.6, kind 4 (dgrad down with the SwiGLU backward, fp8_block's): a = dy [M, H], b0 = W_down's
 * transposed copy [E, I, H] with W_down's scales (b_transposed = 1); out = dh = [dg | du] [M, 2I]
 * float8_e4m3fn, quantised per row and 128 channels, its scales in `out` [2I/128, M]; args' h
 * [M, 2I] and row_weight [M] required, wa (here a = silu(g)·u, bfloat16 [M, I]) and dtw_partials
 * ([M, I/128]: Σ da · a dequantised as the forward quantised it) optional (docs/precision.md).
 * Since 0.6, kind 3 (dgrad gate/up, fp8_block's): a = dh [M, 2I], b0 / b1 = W_gate's and W_up's
 * transposed copies [E, H, I] with their own scales [E, I/128, H/128] (b_transposed = 1): the
 * gate k-blocks from b0, then the up ones from b1; out bf16 [M, H]. */
typedef struct mokGemmBlockScales_t {
  mokTensor_t a, b0, b1;
  mokTensor_t out; /* out's scales when out is float8_e4m3fn (gate/up); absent otherwise */
  int64_t out_pow2; /* out's scales powers of two (UE8M0: the ceiling of max |a| / 448) */
  /* b_transposed != 0: b0 / b1 are transposed copies (mokQuantizeBlocksE4m3's qt) and b0 / b1
   * the scales of the matrices they transpose, [E, K/128, ceil(N/128)] (block (n/128, kb) at
   * [e, kb, n/128]; a 128 x 128 block's scale is its transpose's) */
  int64_t b_transposed;
} mokGemmBlockScales_t;
MOK_API mokResult_t mokGroupedGemmBlockScaled(const mokGroupedGemmArgs_t* args, const mokGemmBlockScales_t* scales,
                                              void* stream);
MOK_API mokResult_t mokGroupedWgrad(const mokGroupedWgradArgs_t* args, void* stream);
/* fp8_block's activation quantiser: x [M, K] bfloat16 (K % 128 == 0) -> q [M, K] float8_e4m3fn
 * and scales [K/128, M] float32 (per row and 128 of K, k-block-major: mokGroupedGemmBlockScaled's
 * a_scales); scale = max |x| / 448 (1 for a block of zeros), q = x / scale rounded to nearest
 * even, saturating (docs/precision.md); pow2 != 0: the scale's power-of-two ceiling instead
 * (UE8M0, 2^ceil(log2(max |x| / 448))).  CUDA tensors, contiguous. */
MOK_API mokResult_t mokQuantizeRowsE4m3(const mokTensor_t* x, const mokTensor_t* q, const mokTensor_t* scales,
                                        int32_t pow2, void* stream);
/* fp8_block's weight quantiser: w [E, R, C] (or [R, C]) bfloat16, R and C multiples of 128, read
 * in place (row- or column-major matrices, as mokWeights_t's) -> scales [E, R/128, C/128] float32,
 * one per 128 x 128 block (max |w| / 448, 1 for zeros; pow2 != 0: its power-of-two ceiling), and
 * w / scale in float8_e4m3fn (nearest even, saturating) in either or both orientations: q [E, R, C]
 * (w's) and qt [E, C, R] (its transpose, which the dgrad kinds read; the scales serve both).  One
 * read of w.  q or qt may be absent (not both); CUDA tensors, q, qt and scales contiguous. */
/* fp8_block's weights, once per optimizer step: for each weight of `weights` whose mokFp8Weight_t
 * in `fp8` is present (its scales given), the scales and whichever of q and qt are given
 * (shapes in mokFp8Weight_t; pow2 != 0: power-of-two scales, UE8M0).  One read of each weight
 * (mokQuantizeBlocksE4m3).  CUDA tensors. */
MOK_API mokResult_t mokQuantizeWeights(const mokConfig_t* config, const mokWeights_t* weights,
                                       const mokFp8Weights_t* fp8, int32_t pow2, void* stream);
MOK_API mokResult_t mokQuantizeBlocksE4m3(const mokTensor_t* w, const mokTensor_t* q, const mokTensor_t* qt,
                                          const mokTensor_t* scales, int32_t pow2, void* stream);
/* fp8_block's weight-gradient kind (since 0.6): out[e] = the sum over expert e's k-blocks of 128
 * rows of (the k-block's e4m3 sum of a[m, r]·b[n, r]) · a_scales[kb, m] · b_scales[kb, n], promoted
 * into fp32 once per k-block (fma, k-block order).  The operands come transposed (K-major, as fp8
 * MMAs read them, mokQuantizeColsE4m3 writes them): a [Mo, R] and b [No, R] float8_e4m3fn, their
 * scales a_scales [R/128, Mo] and b_scales [R/128, No] float32 (per channel and 128 rows).
 * expert_offset [E + 1] / expert_count [E] int32 (device): expert e's rows [offset, + count), the
 * offsets multiples of 128 and the rows past each count up to the next multiple of 128 zero (the
 * plan's padding).  out [E, Mo, No] bfloat16, acc and main_grad [E, Mo, No] float32 as
 * mokGroupedWgrad's.  Mo, No, R multiples of 128.  CUDA tensors, contiguous. */
typedef struct mokGroupedWgradBlockScaledArgs_t {
  mokTensor_t a, b, a_scales, b_scales, expert_offset, expert_count;
  mokTensor_t out, acc, main_grad;
  int64_t accumulate;
  int64_t store_acc;
  int64_t num_blocks;
} mokGroupedWgradBlockScaledArgs_t;
MOK_API mokResult_t mokGroupedWgradBlockScaled(const mokGroupedWgradBlockScaledArgs_t* args, void* stream);
/* The fp8 wgrad operands' quantiser (since 0.6): v [R, C] bfloat16 (R, C multiples of 128) ->
 * qt [C, R] float8_e4m3fn (v transposed) and scales [R/128, C] float32: each column's scale over
 * each 128 rows (max |v| / 448, 1 for zeros; pow2 != 0: its power-of-two ceiling), v / scale
 * rounded to nearest even, saturating.  CUDA tensors, contiguous. */
MOK_API mokResult_t mokQuantizeColsE4m3(const mokTensor_t* v, const mokTensor_t* qt, const mokTensor_t* scales,
                                        int32_t pow2, void* stream);

/* Copies the timing ring of the last call (synchronising) into buffer; *needed (if not NULL)
 * gets its size in bytes, 0 when the workspace records none (MOK_TRACE unset at creation);
 * *events_per_recorder (if not NULL) gets `cap`.  buffer == NULL only asks for the sizes. */
MOK_API mokResult_t mokWorkspaceReadTrace(mokWorkspace_t workspace, void* buffer, size_t buffer_size,
                                          size_t* needed, int64_t* events_per_recorder);

/* One rank's layer.  CPU tensors run the reference backend (EP = 1; the EP group on the CPU is
 * mokForwardEmulated); CUDA tensors run the GPU forward on `stream` (a cudaStream_t; NULL =
 * default stream) with no host synchronisation: EP = 1 with a mokWorkspaceCreate workspace,
 * EP >= 2 with a mokWorkspaceCreateSymmetric one (every rank of the group calls it). */
MOK_API mokResult_t mokForward(mokWorkspace_t workspace, const mokForwardArgs_t* args, void* stream);
MOK_API mokResult_t mokBackward(mokWorkspace_t workspace, const mokBackwardArgs_t* args, void* stream);
/* mokForward that also writes `saved` (CUDA tensors), and mokBackward that reads it instead of
 * recomputing the pre-activations: the same gradients, bit for bit. */
MOK_API mokResult_t mokForwardSave(mokWorkspace_t workspace, const mokForwardArgs_t* args, const mokSaved_t* saved,
                                   void* stream);
MOK_API mokResult_t mokBackwardSaved(mokWorkspace_t workspace, const mokBackwardArgs_t* args,
                                     const mokSaved_t* saved, void* stream);

/* One call of every rank of an EP group driven from this process (virtual ranks on one GPU, or
 * several GPUs of one process): rank r = workspaces[r] (its config.ep_rank == r) on streams[r].
 * The same as mokForward(workspaces[r], &args[r], streams[r]) for every r, except that every
 * rank is checked before any launch, and the launches are issued phase by phase across the
 * ranks (start, plan, layer), so that the ranks never wait on each other through a hardware
 * queue their streams share (more streams than CUDA_DEVICE_MAX_CONNECTIONS share queues). */
MOK_API mokResult_t mokForwardGroup(const mokWorkspace_t* workspaces, const mokForwardArgs_t* args,
                                    int64_t num_ranks, void* const* streams);

/* The backward of every rank of an EP group driven from this process, as mokForwardGroup:
 * every rank checked before any launch, then issued phase by phase across the ranks.  saved:
 * NULL (the pre-activations are recomputed), or num_ranks entries from mokForwardSave. */
MOK_API mokResult_t mokBackwardGroup(const mokWorkspace_t* workspaces, const mokBackwardArgs_t* args,
                                     const mokSaved_t* saved, int64_t num_ranks, void* const* streams);

/* The whole EP group emulated in one process on the CPU reference backend:
 * args[r] holds rank r's inputs, its local weights and its outputs, for r in [0, ep_size).
 * ep_size must equal config->ep_size (it is the length of args). */
MOK_API mokResult_t mokForwardEmulated(const mokConfig_t* config, const mokForwardArgs_t* args,
                                       int64_t ep_size);
MOK_API mokResult_t mokBackwardEmulated(const mokConfig_t* config, const mokBackwardArgs_t* args,
                                        int64_t ep_size);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // MOK_MOK_H_
