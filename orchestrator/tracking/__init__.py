"""MLflow tracking for a sweep: one parent run per sweep, one nested child run per Tune trial.

Why not Ray's ``MLflowLoggerCallback``: it re-logs params at every actor start, and MLflow
refuses a changed param ("Changing param values is not allowed", ray #27783) - exactly what a
trial retried with a smaller plan does. Here what never changes during a trial (workload,
hyper-parameters, estimator, budget, GPU) is logged as params once; what can change (the plan)
is logged with every result as metrics, as a ``plan_history.json`` artifact once it has changed (the
first plan and each change), and as ``plan.*`` params only when the trial has ended. Params are only ever added, never changed.

What a trial costs MLflow, since sweeps are hundreds of short trials: a run created with its
tags, then its writes sent a round at a time (a second after the first of them was queued), each
run's writes of a round as one ``log_batch`` of params, tags and results followed by its end
(:mod:`~orchestrator.tracking.batching`); a run this driver created is not looked up again, nor
its params or status re-read.

Why a queue: a tracking server can be away for a while (restart, network). Every write is an
operation on an ordered queue that one background thread sends, so the Tune driver never waits
on MLflow and a sweep never fails because of it. An outage (nothing answers, a timeout, a 5xx,
a SQLite store locked by another process, credentials refused) is waited out: the operation is
resent until it lands. Only a rejection of the data itself (a 4xx such as an invalid value)
drops an operation, after a few attempts, and the drop is reported: the sweep run is marked
FAILED and ``run`` exits non-zero (:class:`orchestrator.outcome.TrackingDelivery`). What is still
queued is part of this callback's Tune state (saved with each experiment checkpoint) and, at the
end of a sweep that could not send everything, is kept in the sweep's folder
(:data:`orchestrator.tracking.callback.UNSENT_FILE`), so ``run --resume`` sends it. Every operation is idempotent, so sending
one twice is harmless: runs are looked up by tags before they are created, a result is sent
only if the run does not have that step of the ``step`` metric yet (re-read from MLflow after
any failure, since a request may land although its reply was lost), params are only added,
artifacts are overwritten.

The package, one module per concern (none of them is imported here: ``orchestrator report``
reads :mod:`~orchestrator.tracking.runs`, :mod:`~orchestrator.tracking.store` and
:mod:`~orchestrator.tracking.reader` without loading Ray):

* :mod:`~orchestrator.tracking.runs`: how a sweep's runs are found in MLflow (tags, the step metric, the store's file);
* :mod:`~orchestrator.tracking.operations`: the writes, each one idempotent;
* :mod:`~orchestrator.tracking.writer`: the MLflow client that applies them;
* :mod:`~orchestrator.tracking.batching`: a round's writes to one run merged into one request;
* :mod:`~orchestrator.tracking.outbox`: the queue and the thread that sends them, waiting out outages;
* :mod:`~orchestrator.tracking.check`: the tracking store checked before a sweep starts;
* :mod:`~orchestrator.tracking.store`: a store that cannot be used, said in one line (``run`` and ``report``);
* :mod:`~orchestrator.tracking.reader`: a sweep's trial runs read back whole in a few requests (``report``);
* :mod:`~orchestrator.tracking.flatten`: a spec, a plan and a result as MLflow params and metrics;
* :mod:`~orchestrator.tracking.callback`: the Tune callback that turns a sweep's events into writes.
"""
