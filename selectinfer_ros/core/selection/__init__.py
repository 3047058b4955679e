"""Which neurons: task profiles, the selective loader (gamma) and the selective MLP (phi)."""
