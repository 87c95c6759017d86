"""Runs on GPU nodes: the trainer runtime and the node agent. Never imports Django."""
