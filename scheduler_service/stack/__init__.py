"""The local ElasticFlow stack: deployments of the `train` flow on an
`elasticflow` work pool (the worker itself lives in `scheduler_service.worker`)."""
