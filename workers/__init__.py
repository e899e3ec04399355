"""GPU workers: the engine core, the model, parallel execution, and the Celery GPU worker."""
