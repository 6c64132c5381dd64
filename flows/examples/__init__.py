"""Example training tasks shipped with the platform, each a model, a dataset
and a loss named by import path (docs/user-guide.md, "Bring your own task"):

- `flows.examples.regression`: regression on generated data, its own
  `Dataset` class, a mean-squared-error loss and an evaluation;
- `flows.examples.causal_lm`: a tiny language model built from a config that
  computes its own loss when given `labels`, as Hugging Face models do.

Deployed as `train/regression` and `train/causal-lm` (prefect.yaml). The
module prefix `flows.examples` is allowed without the operator's
`ELASTICFLOW_MODEL_MODULES`: it is the platform's own code.
"""
