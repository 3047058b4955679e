"""Runnable examples against the running nodes."""
