"""The paper's baselines, one module each, behind the same policy interface."""
