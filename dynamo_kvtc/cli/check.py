"""``dynamo-kvtc check`` (the work: :mod:`dynamo_kvtc.evaluation.check`)."""

from __future__ import annotations

import argparse

from . import types

HELP = "check a calibration with its model before serving: accuracy per ratio, the largest ratio within a budget"

EPILOG = (
    "A ratio passes when its mean ΔNLL on held-out text is within --budget-dnll percent of vanilla's NLL (default 1), "
    "its mean KL within --budget-kl (default 0.025), its top-1 agreement with vanilla at least --budget-top1 (default "
    "0.9), and it finds as many passkeys as vanilla (less --passkey-slack, default 0). A task vanilla itself fails "
    "(no passkey found, an NLL near ln(vocab)) is reported as uninformative; when no task informs there is no verdict "
    "ratio. The largest ratio at which it and every lower ratio pass is the verdict; --write "
    "records it in the calibration directory's check.json (the calibration id is unchanged) and the connector's "
    "`ratio: auto` serves at it."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("calibration", type=types.existing_dir, help="calibration directory")
    p.add_argument("--model", required=True, help="the served model: a checkpoint path, a hub id or an embedded name")
    p.add_argument(
        "--budget-dnll",
        type=types.nonneg_float,
        default=1.0,
        metavar="PCT",
        help="largest mean ΔNLL, in percent of vanilla's NLL (default 1)",
    )
    p.add_argument(
        "--budget-kl",
        type=types.nonneg_float,
        default=0.025,
        metavar="X",
        help="largest mean KL divergence from vanilla, nats per token (default 0.025)",
    )
    p.add_argument(
        "--budget-top1",
        type=types.nonneg_float,
        default=0.9,
        metavar="F",
        help="least top-1 agreement with vanilla's next-token predictions, 0..1 (default 0.9)",
    )
    p.add_argument(
        "--passkey-slack",
        type=types.nonneg_int,
        default=0,
        metavar="N",
        help="passkeys a ratio may miss that vanilla finds (default 0: as many as vanilla)",
    )
    p.add_argument("--ratios", type=types.ratios, default=None, help="ratios to check (default: every plan)")
    p.add_argument(
        "--passkey-lengths",
        type=types.positive_ints,
        default=[1024, 2048],
        help="passkey haystack lengths in tokens, comma-separated (default 1024,2048)",
    )
    p.add_argument(
        "--depths",
        type=types.depths,
        default=(0.2, 0.5, 0.8),
        help="needle depths in each haystack, comma-separated (default 0.2,0.5,0.8)",
    )
    p.add_argument(
        "--ppl-length",
        type=types.positive_int,
        default=1024,
        help="tokens of each held-out perplexity window (default 1024)",
    )
    p.add_argument(
        "--ppl-scored", type=types.positive_int, default=128, help="tokens scored after each window (default 128)"
    )
    p.add_argument("--ppl-windows", type=types.positive_int, default=2, help="perplexity windows (default 2)")
    p.add_argument("--device", default="cpu", help="where the model and codec run: cpu (default) or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write", action="store_true", help="record the verdict in the calibration's check.json")
    p.add_argument("--json", dest="json_path", help="write the verdict, metrics and machine as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from ..evaluation.check import run_check_command

    return run_check_command(args)
