"""Command line for the simulator: ``python -m jobs.simulator.cli`` and ``manage.py simulate``.

``simulate SCENARIO.json [--policy omni|static|kill_preempt|all] [--json] [--events]
[--html FILE] [--progress]``. Without ``--json`` it prints a small side-by-side table of the
policies. A bad scenario file exits with status 2 and one line on stderr naming the field
(``jobs[3].tp: 16 exceeds gpus_per_node 8``), never a traceback. Progress goes to stderr once
per simulated day, only when stderr is a terminal or with ``--progress``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from jobs.simulator.engine import POLICIES, simulate, stderr_progress
from jobs.simulator.scenario import ScenarioError, load_scenario

EXIT_OK = 0
EXIT_BAD_INPUT = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's arguments (shared by the CLI and the management command)."""
    parser.add_argument("scenario", help="scenario JSON file (see docs/simulator.md)")
    parser.add_argument("--policy", choices=(*POLICIES, "all"), default="all",
                        help="which policy to replay (default: all three side by side)")
    parser.add_argument("--json", action="store_true", help="print results as JSON (a list with --policy all)")
    parser.add_argument("--events", action="store_true", help="include the ordered audit records in the JSON")
    parser.add_argument("--html", metavar="FILE", help="also write a Plotly HTML report to FILE")
    parser.add_argument("--progress", action="store_true", help="report progress per simulated day on stderr")


def format_table(results: list[dict[str, Any]]) -> str:
    """A small plain-text table of the policies side by side."""
    first = results[0]
    lines = [f"scenario: {first['scenario']}  (horizon {first['horizon_s'] / 3600:.1f} h, "
             f"{len(first['jobs'])} jobs)"]
    header = f"{'policy':<13} {'utilization':>11} {'shortfall':>10} {'preempt(graceful)':>18} {'lost GPU-s':>12} {'violations':>10}"
    lines.append(header)
    lines.append("-" * len(header))
    for r in results:
        pre = f"{r['preemptions']} ({r['graceful_preemptions']})"
        lines.append(
            f"{r['policy']:<13} {r['utilization'] * 100:>10.1f}% {r['reservation_shortfall'] * 100:>9.2f}% "
            f"{pre:>18} {r['lost_gpu_s']:>12.0f} {len(r['invariant_violations']):>10}"
        )
    for r in results:
        if "quota_shortfall" in r:
            jain = "n/a" if r["jain_index"] is None else f"{r['jain_index']:.3f}"
            lines.append(f"  [{r['policy']}] teams: quota shortfall {r['quota_shortfall'] * 100:.2f}%, "
                         f"Jain's index {jain}")
    for r in results:
        for v in r["invariant_violations"][:5]:
            lines.append(f"  [{r['policy']}] {v}")
    return "\n".join(lines) + "\n"


def run(options: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """Run the simulator for parsed ``options``; returns the exit status."""
    try:
        scenario = load_scenario(options.scenario)
    except ScenarioError as exc:
        stderr.write(f"{exc}\n")
        return EXIT_BAD_INPUT
    policies = list(POLICIES) if options.policy == "all" else [options.policy]
    show_progress = bool(options.progress) or (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
    results = [
        simulate(scenario, policy, record_events=bool(options.events),
                 progress=stderr_progress if show_progress else None)
        for policy in policies
    ]
    if options.html:
        try:
            from jobs.simulator import report
        except ImportError:
            stderr.write("--html: the report module jobs.simulator.report is not available\n")
            return EXIT_BAD_INPUT
        try:
            report.write_html(results, options.html)
        except OSError as exc:
            stderr.write(f"--html {options.html}: {exc.strerror or exc}\n")
            return EXIT_BAD_INPUT
    if options.json:
        payload: Any = results if options.policy == "all" else results[0]
        stdout.write(json.dumps(payload) + "\n")
    else:
        stdout.write(format_table(results))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv`` and run; returns the exit status."""
    parser = argparse.ArgumentParser(prog="simulate", description="Replay a scenario under the scheduling policies.")
    add_arguments(parser)
    options = parser.parse_args(argv)
    return run(options, sys.stdout, sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
