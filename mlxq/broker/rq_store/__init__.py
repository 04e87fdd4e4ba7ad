"""Everything mlxq knows about RQ, in one package: its key names, its job states, the private
attributes mlxq relies on, and every write that moves a job from one state to another.
Nothing outside this package spells an RQ key.

Each state change also moves the job between its batch's counters (``keys.batch_counts``:
queued, started, finished, failed, cancelled, expired) in the same Redis transaction, so a
batch's status is one read however many jobs it has. The job's own hash remembers which
counter it is in (field ``mlxq_state``; none yet means queued), and a small script moves
it only if it changes, so a transition applied twice (two sweepers, a retried write)
counts once.

Every job that ends (finished, error, timeout, expired, cancelled) stores one full mlxq
``Result`` as its RQ result's return value, the same way, so readers never rebuild one.

Modules: ``rq_keys`` (RQ's key names), ``internals`` (RQ's private attributes mlxq relies
on), ``states`` (RQ's job states as mlxq reads them, and their batch counters),
``counters`` (moving a job between its batch's counters), ``reads`` (job states, metas and
results), ``transitions`` (how workers and sweepers start, end, retry and put back jobs),
``cancel_retry`` (cancelling waiting jobs, retrying failed ones).
"""
