"""Small commands for machines without ros2cli: generate, switch, diagnostics."""
