"""Command line for the simulator: ``python -m jobs.simulator.cli`` and ``manage.py simulate``.

``simulate SCENARIO.json [--policy omni|static|kill_preempt|slurm|kueue|elastic|all] [--json]
[--events] [--html FILE] [--progress]``. Without ``--json`` it prints a small side-by-side table
of the policies, then each one's completion time and queueing delay per class, then where omni
stands against the peers figure by figure (``jobs.simulator.verdict``). A bad scenario file exits with status 2 and one line on stderr naming the field
(``jobs[3].tp: 16 exceeds gpus_per_node 8``), never a traceback. Progress goes to stderr once
per simulated day, only when stderr is a terminal or with ``--progress``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from jobs.simulator.engine import POLICIES, simulate, stderr_progress
from jobs.simulator.results import where_gpu_s_went, where_rows
from jobs.simulator.scenario import ScenarioError, load_scenario
from jobs.simulator.verdict import format_verdict, verdict

EXIT_OK = 0
EXIT_BAD_INPUT = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's arguments (shared by the CLI and the management command)."""
    parser.add_argument("scenario", help="scenario JSON file (see docs/simulator.md)")
    parser.add_argument("--policy", choices=(*POLICIES, "all"), default="all",
                        help="which policy to replay (default: all of them side by side)")
    parser.add_argument("--json", action="store_true", help="print results as JSON (a list with --policy all)")
    parser.add_argument("--events", action="store_true", help="include the ordered audit records in the JSON")
    parser.add_argument("--html", metavar="FILE", help="also write a Plotly HTML report to FILE")
    parser.add_argument("--progress", action="store_true", help="report progress per simulated day on stderr")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def format_table(results: list[dict[str, Any]]) -> str:
    """A small plain-text table of the policies side by side."""
    first = results[0]
    bound = first.get("utilization_bound")
    lines = [f"scenario: {first['scenario']}  (horizon {first['horizon_s'] / 3600:.1f} h, "
             f"{len(first['jobs'])} jobs" + (f", fluid bound {bound * 100:.1f}%" if bound is not None else "") + ")"]
    header = (f"{'policy':<13} {'utilization':>11} {'goodput':>8} {'of bound':>8} {'shortfall':>10} "
              f"{'res. wait':>9} {'preempt(graceful)':>18} {'per done':>8} {'lost GPU-s':>12} "
              f"{'violations':>10}")
    lines.append(header)
    lines.append("-" * len(header))
    for r in results:
        pre = f"{r['preemptions']} ({r['graceful_preemptions']})"
        per = r.get("preemptions_per_completed_job")
        lines.append(
            f"{r['policy']:<13} {r['utilization'] * 100:>10.1f}% {r.get('goodput', 0) * 100:>7.1f}% "
            f"{r.get('bound_share', 0) * 100:>7.1f}% {r['reservation_shortfall'] * 100:>9.2f}% "
            f"{r.get('reservation_wait', 0) * 100:>8.2f}% {pre:>18} {'-' if per is None else f'{per:.2f}':>8} "
            f"{r['lost_gpu_s']:>12.0f} {len(r['invariant_violations']):>10}"
        )
    lines.append("completion time / queueing delay, median and p95 in seconds, per class (done/jobs):")
    for r in results:
        parts = []
        for cls, fig in (r.get("classes") or {}).items():
            if cls == "all" or not fig["jobs"]:
                continue
            parts.append(f"{cls} ({fig['completed']}/{fig['jobs']}) jct {_seconds(fig['jct_median_s'])}/"
                         f"{_seconds(fig['jct_p95_s'])} (to horizon {_seconds(fig['jct_horizon_median_s'])}/"
                         f"{_seconds(fig['jct_horizon_p95_s'])}) queue {_seconds(fig['queue_median_s'])}/"
                         f"{_seconds(fig['queue_p95_s'])}")
        lines.append(f"  [{r['policy']}] " + "; ".join(parts))
    shares = [where_gpu_s_went(r) for r in results]
    if all(share is not None for share in shares):
        rows = where_rows(shares)
        lines.append("where the healthy GPU-seconds went, %: " + "; ".join(f"{short}: {words}" for _, short, words in rows))
        columns = [(key, short, max(6, len(short))) for key, short, _ in rows]
        lines.append(f"{'policy':<13}" + "".join(f" {short:>{w}}" for _, short, w in columns))
        for r, share in zip(results, shares, strict=True):
            lines.append(f"{r['policy']:<13}" + "".join(f" {share.get(k, 0.0) * 100:>{w}.2f}" for k, _, w in columns))
    for r in results:
        if "quota_shortfall" in r:
            jain = "n/a" if r["jain_index"] is None else f"{r['jain_index']:.3f}"
            lines.append(f"  [{r['policy']}] teams: quota shortfall {r['quota_shortfall'] * 100:.2f}%, "
                         f"Jain's index {jain}")
    for r in results:
        for v in r["invariant_violations"][:5]:
            lines.append(f"  [{r['policy']}] {v}")
    return "\n".join(lines) + "\n" + format_verdict(verdict(results))


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
