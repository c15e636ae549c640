"""The leader: the one control process that holds the leader row and places work.

* ``leadership`` - take, renew and lose the Postgres leader row (its fencing epoch);
* ``state`` - the in-memory cluster and queue, rebuilt on takeover, refreshed from the
  change feed;
* ``cycle`` - the placement cycles: plan, commit under the epoch, publish;
* ``signals`` - allocations and preemptions delivered to job workflows at least once.
"""
