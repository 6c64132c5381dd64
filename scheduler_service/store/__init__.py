"""The project's SQLModel store (SQLite under $ELASTICFLOW_HOME by default)."""

from scheduler_service.store.db import database_url, get_engine
from scheduler_service.store.throughput import ThroughputMeasurement, export_csv, get_curve, get_curves, save_curve

__all__ = ["ThroughputMeasurement", "database_url", "export_csv", "get_curve", "get_curves", "get_engine",
           "save_curve"]
