"""Jobs, nodes, reservations, allocations, commands and the elastic-adjustment audit log."""
