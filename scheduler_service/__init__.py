"""ElasticFlow scheduler service: the pure scheduling policy, the trace simulator
that evaluates it, and (later) the Prefect work pool that runs it for real."""
