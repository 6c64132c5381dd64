"""Trace-driven simulator: runs the very same policy objects as the service."""
