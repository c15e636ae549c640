"""The SQL store: every read and write of Postgres, the platform's source of truth.

One module per kind of row; every function takes a pool or a connection (``store.tx.Db``)
and runs its SQL in one transaction, raising the typed errors of ``store.errors``:

* ``tx`` - transactions; ``errors`` - typed errors; ``audit`` - audit and job-event rows;
* ``leadership`` - the leader row and its fencing epoch;
* ``allocations`` - gangs, leases and allocation rows (the invariant-bearing writes);
* ``jobs`` / ``job_spec`` / ``job_states`` - job rows, the stored spec, state changes;
* ``publications`` - what each placement cycle publishes (positions, reasons, reservations);
* ``leader_view`` - the leader's reads: the full snapshot on takeover and refreshes;
* ``change_feed`` - the ``changes`` sequence the leader follows;
* ``nodes``, ``teams``, ``idempotency``, ``seed`` - nodes, quotas, API keys, the inventory.

The store imports ``placement`` (the job state table) and ``common`` only; activities,
the API, the leader and the health monitor all use it (import-linter keeps it so).
"""
