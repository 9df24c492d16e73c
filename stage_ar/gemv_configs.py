"""Launch parameters of `stage_ar.gemv`'s kernels: the K tile per weight dtype, the `GemvConfig`
record, the candidate sets autotuning times (per weight dtype), and the shared-memory fit check.

What may be a candidate: anything that places work without reordering a row's sums, checked on the
GPU to give the same bits as the other candidates of its set (`benchmarks/gemv_sweep.py`), so that
which one timing picks in a process changes no output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import torch

from mammoth_core.small_files import read_small_file

FP8_DTYPE = torch.float8_e4m3fn


def block_k_for(weight_dtype: torch.dtype) -> int:
    """The K tile for weights of ``weight_dtype``: 256 columns for every dtype (512 bytes of each
    16-bit weight row per tile, 256 of FP8). Fixed, because it sets a row's reduction order (the
    inverse RMS tree; the dot's K order is the same for any tile width)."""
    del weight_dtype  # one width for all today; the argument keeps the choice in one place
    return 256


def split_k_for(n: int, k: int, weight_dtype: torch.dtype, fp8_compute: str | None = None) -> int:
    """How many K ranges a launch of ``n`` output columns over ``k`` input columns of ``weight_dtype``
    weights splits into (each summed by its own programs, then added in range order by the last one
    to finish: `stage_ar.gemv`). A function of the shape and the weights' form (``fp8_compute``: the
    W8A8 launches have their own candidate set, `W8A8_TUNED_CONFIGS`), never of M or of timing,
    because it sets a row's reduction order (its bits).

    W8A8 (``fp8_compute="fp8"``): `W8A8_SPLIT_K` ranges (today 1: no split) for at most
    `W8A8_SPLIT_MAX_COLUMNS` output columns and 8 K tiles or more, else 1. Other FP8 weights of at
    most `SPLIT_MAX_COLUMNS` output columns split into ``min(8, tiles // 2)`` ranges
    (``tiles`` K tiles of `block_k_for`): qkv and o (K = 3,584, 14 tiles) into 7, down (K = 18,944) into 8.
    Their 256-byte row tiles put too few bytes in flight on 132 SMs; on the H200 (2026-12-03,
    `benchmarks/gemv_split_k.py`, float16 products, M = 1) this took down from 41.9 to 29.6 us, qkv
    from 20.4 to 17.1, o from 10.5 to 9.5: 3.85 -> 3.36 ms of GEMVs per visual token; W8A8 3.65 ->
    3.36. bf16 weights never split (every split measured slower: o 9.2 -> 11.1 us at 2), nor do the
    wide shapes (gate_up, the head: within 1 % or slower).
    """
    if weight_dtype != FP8_DTYPE or n > SPLIT_MAX_COLUMNS:
        return 1
    tiles = -(-k // block_k_for(weight_dtype))
    if fp8_compute == "fp8":  # W8A8's 64-column launches: the narrowest outputs only
        return W8A8_SPLIT_K if n <= W8A8_SPLIT_MAX_COLUMNS and tiles >= 8 else 1
    return max(1, min(8, tiles // 2))


#: The widest output (columns) `split_k_for` splits: qkv's 4,608; gate_up's 18,944 and the head's 16,392 stay whole.
SPLIT_MAX_COLUMNS = 8192


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of one kernel: output columns per program, warps, software-pipeline depth.

    ``block_k`` ``None`` means `block_k_for` the weight dtype, ``split_k`` ``None`` `split_k_for` the
    shape; another value changes a row's reduction order (its bits), so it is for exploration
    (`benchmarks/gemv.py`, `benchmarks/gemv_split_k.py`), never for serving.
    """

    block_n: int
    num_warps: int = 4
    num_stages: int = 4
    block_k: int | None = None
    split_k: int | None = None


#: Candidates autotuning times on the GPU for 16-bit weights (pruned where the pipeline would not fit
#: shared memory). ``block_n`` 16 and 32 lower to ``mma.sync`` (m16n8k16), 64 to Hopper's ``wgmma``;
#: for bfloat16 weights all of them give the same bits at every M (`benchmarks/gemv_sweep.py`, H200,
#: 2026-12-01: the whole set bit-identical, a row alone = the row inside M = 16), so which one timing
#: picks in a process changes no output. 64 columns with 4 warps is the fastest qkv (10.7 vs 12.8 us)
#: and head launch; 2 warps the fastest 16/32-column ones.
TUNED_CONFIGS = (
    GemvConfig(16, 4, 3), GemvConfig(16, 4, 4), GemvConfig(16, 4, 6), GemvConfig(16, 8, 4),
    GemvConfig(32, 4, 3), GemvConfig(32, 4, 4), GemvConfig(32, 4, 6), GemvConfig(32, 8, 4),
    GemvConfig(16, 2, 4), GemvConfig(16, 2, 6), GemvConfig(32, 2, 4), GemvConfig(64, 4, 4),
)
#: Candidates for FP8 weights: only ``mma.sync`` ones. With FP8 codes widened in registers, the
#: 64-column (``wgmma``) launches give other bits than the 16/32-column ones (same sweep), so they
#: stay out: a process's pick must not change a row's bits.
FP8_TUNED_CONFIGS = (
    GemvConfig(16, 2, 4), GemvConfig(16, 4, 4), GemvConfig(32, 4, 2), GemvConfig(32, 4, 3),
    GemvConfig(32, 4, 4), GemvConfig(32, 8, 4),
)
#: Candidates for W8A8 launches (``fp8_compute="fp8"``, FP8 x FP8 dots): 64- and 128-column blocks
#: (Hopper ``wgmma`` with the weight tile as its 64-row operand). On the H200 (2026-12-03,
#: `benchmarks/gemv_sweep.py --families w8a8`) every one of them gave the same bits at every split
#: count and streamed faster than the ``mma.sync`` set at each Preview shape (plain linear, M = 1,
#: best of each: qkv 7.2 vs 9.7 us, o 6.7 vs 7.7, gate_up 34.3 vs 39.4, down 20.8 vs 24.3); the
#: 16/32-column launches give other bits, so they stay out of this set. The 6- and 8-stage pipelines
#: (2026-12-06) are what lets an unsplit o or down launch keep enough bytes in flight (`W8A8_SPLIT_K`).
W8A8_TUNED_CONFIGS = (
    GemvConfig(64, 4, 3), GemvConfig(64, 4, 4), GemvConfig(64, 4, 6), GemvConfig(64, 4, 8),
    GemvConfig(64, 8, 4), GemvConfig(128, 8, 4),
)
#: The widest output a W8A8 launch may split (`split_k_for`): o and down (3,584 columns).
W8A8_SPLIT_MAX_COLUMNS = 4096
#: K ranges of those W8A8 launches: 1, no split (was 4 until 2026-12-06). A row's bits follow it, so it
#: is a rule, not a timing pick. With 3-4 pipeline stages the 56 programs of an unsplit 64-column
#: launch had too few bytes in flight, and 4 ranges won on the H200 (2026-12-03, `benchmarks/gemv_split_k.py
#: --forms w8a8`, M = 1, us at 1 / 2 / 4 / 7-8 ranges: o 10.0 / 9.5 / **9.0** / 11.0, down 28.5 / 24.0 /
#: **22.4** / 25.2); the split's partials and last-arrival sum then cost a serial tail. With 6-8 stages
#: (20-24 KB each; 160-192 KB of shared memory) one program per column block keeps enough in flight:
#: on the H100 (2026-12-06, `docs/measurements/gemv_w8a8_stages_split_h100_2026-12-06.json`, decoder
#: form, M = 1, us) o 9.27 (4 ranges, 3 stages, the old pick) -> **7.61** (unsplit, 8 stages), down
#: 29.00 -> **27.22**; every unsplit 64/128-column candidate gave the same bits. In the decode step
#: (H100, 2026-12-06, `benchmarks/ar_inprocess_ab.py OUT 1 split`, one process, W8A8 batch 1, ms per
#: step): 4 ranges 3.186, unsplit **3.086**, 4 ranges 3.192, unsplit **3.089**; on the H200 (2026-12-06, the
#: same command with ``split,attn``): 4 ranges 2.425 / 2.425, unsplit **2.362 / 2.362**.
W8A8_SPLIT_K = 1
#: The interpreter's fixed launch (it has no timing to tune on). It runs the programs one after another
#: and pays per program, so wide column blocks: 128 columns took the CPU tests' interpreted decodes
#: to about half their time at 16 (2026-12-07, 2-core host: `test_trimmed_gemv_rows_keep_every_live_row_bit_for_bit`
#: 44.6 -> 24.0 s, the W8A8 batch-invariance test 28.4 -> 19.6 s); 512 was slower again (38.7 s).
#: Every interpreted test runs this one launch (numpy's matmul, the interpreter's ``tl.dot``, may sum
#: in a shape-dependent order, so the interpreter's bits are compared only within it).
INTERPRETER_CONFIG = GemvConfig(128, 4, 1)
_SMEM_BUDGET = 200 * 1024


def fits_shared_memory(config: GemvConfig, x_dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
    """Whether ``config``'s pipelined tiles (``num_stages`` x (weight tile + 16-row activation tile))
    fit the budget this module allows (200 KB of the H200's 227 KB per block). A paired launch (the
    SwiGLU and RoPE epilogues) has the same one tile: half its rows are the pairs' partners."""
    block_k = config.block_k or block_k_for(weight_dtype)
    w_bytes = torch.empty((), dtype=weight_dtype).element_size()
    x_bytes = torch.empty((), dtype=x_dtype).element_size()
    return config.num_stages * block_k * (config.block_n * w_bytes + 16 * x_bytes) <= _SMEM_BUDGET


def tuned_configs(weight_dtype: torch.dtype, fp8_compute: str | None = None) -> tuple[GemvConfig, ...]:
    """The candidate set autotuning times for weights of ``weight_dtype`` multiplied as ``fp8_compute``
    says (`stage_ar.gemv`'s argument): `TUNED_CONFIGS`, `FP8_TUNED_CONFIGS` or `W8A8_TUNED_CONFIGS`."""
    if weight_dtype != FP8_DTYPE:
        return TUNED_CONFIGS
    return W8A8_TUNED_CONFIGS if fp8_compute == "fp8" else FP8_TUNED_CONFIGS


# ---- pinned picks -------------------------------------------------------------------------------
#: Environment variable naming a JSON file of pinned picks (`load_picks`); unset: the file shipped
#: for this GPU in ``stage_ar/gemv_picks/`` (`shipped_picks_path`), if any.
PICKS_ENV = "MAMMOTH_GEMV_PICKS"
#: Schema version of a picks file.
PICKS_VERSION = 1
#: The largest picks file read, in bytes (a shipped one is about 5 KB: one line per GEMV variant).
PICKS_MAX_BYTES = 1 << 20


#: The GEMV's autotuning key (`stage_ar.gemv`'s autotuner, `pick_key`): N, K and the compile-time
#: flags, not M; PRELOAD: tiles held in registers.
TUNING_KEY = ("N", "K", "BLOCK_K", "NORM", "FP8", "HAS_BIAS", "SWIGLU", "RESIDUAL", "FP8_MODE", "ROPE", "HEAD_DIM",
              "SPLIT_K", "AMAX_OUT", "PRELOAD")


def pick_key(meta: dict, x_dtype: torch.dtype, weight_dtype: torch.dtype, out_dtype: torch.dtype) -> str:
    """The text key of one GEMV variant and shape in a picks file: ``name=value`` of each name of
    `TUNING_KEY` present in ``meta``, then the three dtypes. Rows (M) are not in it, as they are not
    in the autotuning key."""
    parts = [f"{name}={int(meta[name]) if isinstance(meta[name], bool) else meta[name]}"
             for name in TUNING_KEY if name in meta]
    parts += [f"x={x_dtype}".replace("torch.", ""), f"w={weight_dtype}".replace("torch.", ""),
              f"out={out_dtype}".replace("torch.", "")]
    return ",".join(parts)


def shipped_picks_path(device_name: str) -> str:
    """Where the picks shipped for a GPU named ``device_name`` (``torch.cuda.get_device_name``) live:
    ``stage_ar/gemv_picks/<name with every non-alphanumeric run as one underscore>.json``."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemv_picks", f"{slug}.json")


def load_picks(path: str) -> dict[str, GemvConfig]:
    """Read a picks file: ``{"version": 1, "device": ..., "picks": {key: [block_n, num_warps,
    num_stages]}}`` (`pick_key`'s keys; written by `benchmarks/gemv_pick.py`). The picks fix which
    candidate each shape launches with, so every process on that GPU runs the same configs instead
    of what its own timing at start-up chose (which varies between processes by a few per cent).
    Only a regular file of at most `PICKS_MAX_BYTES` is read (opened without blocking: a FIFO named
    by mistake hung the AR's start where Ctrl-C could not end it).

    Raises:
        ValueError: naming ``path``: not a regular file, larger than `PICKS_MAX_BYTES`, not UTF-8 JSON
            (nested too deep included), or not such a file (wrong version, malformed entries).
        OSError: the file cannot be opened or read (missing, no permission).
    """
    raw = read_small_file(path, PICKS_MAX_BYTES, "a picks file")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path} is not JSON: {exc}") from None

    def positive_int(v: object) -> bool:
        return type(v) is int and v > 0  # not a bool

    if not isinstance(data, dict) or type(data.get("version")) is not int or data["version"] != PICKS_VERSION \
            or not isinstance(data.get("picks"), dict):
        raise ValueError(f"{path}: not a GEMV picks file of version {PICKS_VERSION}")
    picks = {}
    for key, value in data["picks"].items():
        if not (isinstance(value, list) and len(value) == 3 and all(positive_int(v) for v in value)):
            raise ValueError(f"{path}: pick {key!r} must be [block_n, num_warps, num_stages], got {value!r}")
        picks[key] = GemvConfig(*value)
    return picks
