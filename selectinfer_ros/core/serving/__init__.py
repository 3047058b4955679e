"""What the nodes and the CLI serve: a loaded runtime and the goal queue with its worker."""
