"""The discrete-event simulator: replays scenario files under the planner, the static and kill_preempt baselines and the peers (slurm, kueue, elastic).

Pure Python, no Django. ``load_scenario`` validates a file (``jobs.simulator.scenario``),
``simulate`` replays it (``jobs.simulator.engine``), ``jobs.simulator.cli.main`` is the command
line behind ``manage.py simulate``. See docs/simulator.md.
"""

from jobs.simulator.engine import POLICIES, Simulation, simulate
from jobs.simulator.scenario import Scenario, ScenarioError, load_scenario, parse_scenario

__all__ = ["POLICIES", "Scenario", "ScenarioError", "Simulation", "load_scenario", "parse_scenario", "simulate"]
