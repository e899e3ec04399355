"""Requests in, results out: the producer (Client), preprocess/postprocess, batch runs."""

from pagedq.pipeline.client import BatchStatus, Client, JobFailedError, JobNotFoundError, JobStatus
from pagedq.pipeline.protocol import RequestError
from pagedq.store.connection import BrokerUnavailable, NotReplicated

__all__ = ["BatchStatus", "BrokerUnavailable", "Client", "JobFailedError", "JobNotFoundError", "JobStatus",
           "NotReplicated", "RequestError"]
