"""``dynamo-kvtc bench serve`` (the work: :mod:`dynamo_kvtc.bench.serve`)."""

from __future__ import annotations

import argparse

from . import types
from .bench_codec import add_store_shape

HELP = "trace-driven multi-turn serving benchmark: TTFT, TPOT/ITL, goodput, hit rate per system vs host budget and QPS"
MODELS = ("llama-3.1-8b", "mistral-nemo-12b", "smollm2-135m", "tiny")  # bench.serve.run.SERVE_MODELS

EPILOG = """\
workloads (generated from --seed, or replayed with --trace; --param KEY=VALUE sets a generator argument):
  multi-round-qa  LMBenchmark synthetic-multi-round-qa: users x rounds, a shared system prompt, a per-user history,
                  short answers, Poisson arrivals at qps; round r of a user follows its round r-1
                  (users=15 rounds=20 system=1000 history=20000 question=50 answer=100 qps=0.5)
  lmbench         LMBenchmark long_input_short_output at its published parameters and schedule: 15 users x 20
                  rounds, 1,000-token shared system prompt, 20,000-token histories, 100-token answers, 100 s per
                  QPS point, each user asking every users/qps s, users joining staggered, starting in steady state;
                  a QPS sweep of 0.5,1,2 unless --qps or --param qps=... (users=15 rounds=20 system=1000
                  history=20000 question=20 answer=100 duration_s=100)
  conversation    sessions shaped after the Mooncake FAST'25 conversation trace (~12K mean input, ~330 mean output,
                  ~40% of input tokens reused from earlier turns): each turn appends the reply and a new input
                  (sessions=40 qps=0.5 first_median=8500 turn_median=1500 output_median=220 more_turns=0.47
                  max_turns=8 think_s=10 max_input=32000)
  long-doc-qa     LMCache long-doc-qa: a warm-up pass over the documents, then query rounds in random or
                  interleaved order (documents=8 doc_tokens=20000 question=32 answer=100 repeats=2
                  order=random|interleave qps=1)

systems (the same requests, the same host budget, a fresh store each run):
{systems}

The decoder has the model's shape and random weights, the calibration is synthetic: speed only. Host budgets are
fractions of the workload's raw working set (1.0: a raw tier holds every block the workload reuses).

metrics per run: TTFT, TPOT (per request) and ITL (every token gap) mean/p50/p90/p99; goodput under the TTFT SLO
and under the TTFT and TPOT SLOs together; the step-time stretch (steps of the run replayed with the tier idle);
with --qps, the first rate where each system breaks the SLO (fewer than --slo-attainment of its requests meet both).
"""


def _systems(s: str) -> list[str]:
    from ..bench.serve.systems import SYSTEMS

    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in out if x not in SYSTEMS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"systems are {', '.join(SYSTEMS)}; got {s!r}")
    return out


def _fractions(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated numbers expected, got {s!r}") from None
    if not out or any(not x > 0 for x in out):
        raise argparse.ArgumentTypeError(f"positive numbers expected, got {s!r}")
    return out


def _attainment(s: str) -> float:
    x = types.positive_float(s)
    if x > 1:
        raise argparse.ArgumentTypeError(f"a fraction in (0, 1] expected, got {s}")
    return x


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench.serve.systems import SYSTEMS
    from ..bench.serve.workloads import WORKLOADS

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG.format(systems="\n".join(f"  {s.name:<15} {s.doc}" for s in SYSTEMS.values()))
    p.add_argument("--workload", choices=list(WORKLOADS), default="multi-round-qa")
    p.add_argument("--param", type=types.key_value, action="append", help="a workload generator argument, KEY=VALUE")
    p.add_argument("--seed", type=types.nonneg_int, default=0)
    p.add_argument("--trace", type=types.existing_file, help="replay this JSONL trace instead of generating one")
    p.add_argument("--save-trace", help="write the generated trace here (JSONL)")
    p.add_argument("--systems", type=_systems, default=list(SYSTEMS), help="comma-separated (default: all)")
    p.add_argument("--budgets", type=_fractions, default=[1.0, 0.5, 0.25, 0.125, 0.05], help="host budgets, fractions")
    p.add_argument(
        "--qps",
        type=_fractions,
        default=None,
        help="arrival rates to sweep (the workload regenerated at each; JSON: throughput at a p90 TTFT <= --slo)",
    )
    p.add_argument("--model", choices=MODELS, default="llama-3.1-8b", help="decoder and KV shape (tiny: CPU smoke)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--token-budget", type=types.positive_int, default=8192, help="tokens per engine step")
    p.add_argument("--max-seqs", type=types.positive_int, default=8, help="sequences running at once")
    add_store_shape(p)
    p.add_argument(
        "--layer-groups", type=types.positive_int, default=1,
        help="the synthetic calibration's layer groups, each with its own basis (CUDA only; 1: one joint basis, as "
        "the shipped calibrations): a restore decodes group 0 before later groups' bytes have landed",
    )  # fmt: skip
    p.add_argument(
        "--duration-s", type=types.positive_float, default=None,
        help="keep only the requests arriving in the first SECONDS of the generated trace (lmbench: 100 by default)",
    )  # fmt: skip
    p.add_argument("--slo", "--slo-ttft", dest="slo", type=types.positive_float, default=2.0,
                   help="TTFT SLO, seconds (goodput; p90 in throughput_at_slo)")  # fmt: skip
    p.add_argument("--slo-tpot", type=types.positive_float, default=0.1, help="TPOT SLO, seconds (default 0.1)")
    p.add_argument(
        "--slo-attainment", type=_attainment, default=0.9,
        help="a run meets the SLO when this fraction of its requests met both SLOs (the --qps break point)",
    )  # fmt: skip
    p.add_argument(
        "--stretch-samples", type=types.nonneg_int, default=16,
        help="steps per class replayed after each run with the tier idle, for the step-time stretch (0: none)",
    )  # fmt: skip
    p.add_argument("--disk-gb", type=types.nonneg_float, default=0.0, help="a disk tier of this size (0: none)")
    p.add_argument("--disk-dir", type=types.existing_dir, default=None, help="where the disk tiers' folders go")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run per system")
    p.add_argument("--json", dest="json_path", help="write results as JSON")
    p.add_argument("--plot", help="write the plot here (PNG; needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    from ..bench.serve.run import run_bench_serve

    args.param = dict(args.param or [])
    return run_bench_serve(args)
